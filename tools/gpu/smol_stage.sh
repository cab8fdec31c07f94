#!/usr/bin/env bash
# First of two device calls: the SmolLM2 GGUF (98 MB) travels in two halves (.smolA, .smolB;
# the device takes at most 64 MiB a call). This one parks the first half in /tmp.
mkdir -p /tmp/smol && cp .smolA/part /tmp/smol/part00 && ls -la /tmp/smol
