"""What the reward-model role costs: in-process scoring vs the served role (its own process).

Scores ``--batch`` (prompt, response) pairs ``--iters`` times with the reward model loaded in
this process (what a rollout worker does without ``placement.reward``), then starts the
reward server in a child process on ``--device`` and has ``--clients`` threads (standing for
rollout workers) send the same batches through :class:`RewardClient`. Prints one JSON object:
ms per batch in-process, ms per request served (client round trip), pairs/s, the server's
batches (how many requests it merged) and peak memory of the model's device.

    python tools/gpu/reward_role_bench.py --folder models/smol --classifier --device cuda:0 \\
        --batch 64 --clients 4 --iters 20

``--classifier`` turns a causal-LM folder into a sequence-classification one (random head,
saved to a temp folder) so both kinds can be measured from one prepared model.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import shutil
import statistics
import tempfile
import threading
import time

import torch


def _classifier_folder(src: str) -> str:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tempfile.mkdtemp(prefix="rm-bench-")
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _peak_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(torch.device(device)) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _serve(folder: str, device: str, ready: mp.Queue, done: mp.Event, report: mp.Queue) -> None:
    from streamrl.roles.reward_model import HFRewardModel
    from streamrl.roles.reward_server import RewardServer

    torch.set_grad_enabled(False)
    server = RewardServer(HFRewardModel(folder, device))
    ready.put(server.endpoint)
    server.serve(done.is_set)
    report.put({**server.metrics(), "server_peak_mb": _peak_mb(device)})
    server.close()


def _pairs(n: int) -> tuple[list[str], list[str]]:
    prompts = [f"Question {i}: what is {i} + {2 * i}? Answer with the number only." for i in range(n)]
    responses = [f"The answer is {3 * i}." + " Let me explain." * (i % 5) for i in range(n)]
    return prompts, responses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", required=True)
    p.add_argument("--classifier", action="store_true", help="score with a sequence-classification head")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    from streamrl.roles.reward_client import RewardClient
    from streamrl.roles.reward_model import HFRewardModel

    torch.set_grad_enabled(False)
    folder = _classifier_folder(args.folder) if args.classifier else args.folder
    prompts, responses = _pairs(args.batch)
    rm = HFRewardModel(folder, args.device)
    rm(prompts, responses)  # warm-up
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        rm(prompts, responses)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    inproc_peak = _peak_mb(args.device)
    del rm

    ctx = mp.get_context("spawn")
    ready, report, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve, args=(folder, args.device, ready, done, report))
    child.start()
    endpoint = ready.get(timeout=600)
    latencies: list[float] = []
    lock = threading.Lock()

    def worker():
        client = RewardClient(endpoint, timeout_s=120)
        client(prompts, responses)  # warm-up
        for _ in range(args.iters):
            t0 = time.perf_counter()
            client(prompts, responses)
            with lock:
                latencies.append(time.perf_counter() - t0)
        client.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    served = report.get(timeout=60)
    child.join(30)
    if args.classifier:
        shutil.rmtree(folder, ignore_errors=True)  # the temp copy of the model
    print(json.dumps({
        "device": args.device, "kind": "classifier" if args.classifier else "causal", "batch": args.batch,
        "clients": args.clients, "iters": args.iters,
        "inprocess_ms_per_batch": 1000 * statistics.median(times), "inprocess_peak_mb": inproc_peak,
        "served_ms_per_request": 1000 * statistics.median(latencies),
        "served_pairs_per_s": args.clients * (args.iters + 1) * args.batch / wall,
        "served_batches": served["reward/batches"], "served_requests": served["reward/requests"],
        "server_peak_mb": served["server_peak_mb"],
    }, indent=1))


if __name__ == "__main__":
    main()
