"""Evaluation: evaluate() on a real (tiny) model, and the evaluator process in a real run."""
from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from streamrl.config import load_config
from streamrl.evaluate import eval_decoder, evaluate, evaluate_config, eval_set, read_eval_summary
from streamrl.evaluate import main as eval_main
from streamrl.models.factory import load_model_and_tokenizer
from streamrl.rewards import CombinedReward, build_reward, response_texts
from streamrl.tasks import build_task
from streamrl.tasks.registry import Problem
from tests.model_helpers import tiny_llama_folder


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("configs/tiny.yaml", ["eval.size=4", "eval.samples=2", "eval.batch_size=4"])
    model, tok = load_model_and_tokenizer(cfg.model, seed=0)
    return cfg, eval_decoder(cfg, model, tok), tok


def test_evaluate_reports_greedy_accuracy_and_pass_at_k(tiny):
    cfg, decoder, tok = tiny
    res = evaluate_config(decoder, tok, cfg)
    assert res["eval/n"] == 4
    assert set(res) == {"eval/accuracy", "eval/reward_mean", "eval/n", "eval/pass@2", "eval/mean@2", "eval/truncated",
                        "eval/response_tokens_median", "eval/response_tokens_p90"}
    assert 0 <= res["eval/truncated"] <= 1 and 1 <= res["eval/response_tokens_median"] <= cfg.rollout.max_new_tokens
    assert 0 <= res["eval/accuracy"] <= res["eval/reward_mean"] + 1e-9 <= 1 + 1e-9
    assert res == evaluate_config(decoder, tok, cfg)  # greedy and the seeded samples are reproducible


def test_correct_means_the_eval_reward_reaches_one(tiny):
    """A reward that every response satisfies gives accuracy and pass@k 1; one that none does, 0."""
    cfg, decoder, tok = tiny
    problems = [Problem(f"{i}=", "x") for i in range(3)]
    all_right = CombinedReward(["one"], [1.0], [lambda problem, response: 1.0])
    none_right = build_reward("exact_answer")  # answer "x": the random model never writes exactly that line
    kw = dict(chat_template=False, max_new_tokens=4, samples=2)
    assert evaluate(decoder, tok, problems, all_right, **kw)["eval/pass@2"] == 1.0
    mix = [Problem(f"{i}=", "x", fields={"source_dataset": "ab"[i % 2]}) for i in range(3)]
    res = evaluate(decoder, tok, mix, all_right, chat_template=False, max_new_tokens=2)
    assert res["eval/accuracy/a"] == res["eval/accuracy/b"] == 1.0  # per source dataset of a task mix
    res = evaluate(decoder, tok, problems, none_right, **kw)
    assert res["eval/accuracy"] == 0.0 and res["eval/pass@2"] == 0.0


def test_eval_dataset_takes_the_first_rows_with_the_field_mapping(tmp_path):
    path = tmp_path / "held.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"{i}+1", "a": i + 1}) for i in range(10)))
    cfg = load_config(None, [f"eval.dataset={path}", "eval.size=4", "data.prompt_key=q", "data.answer_key=a"])
    assert [p.answer for p in eval_set(cfg, build_task(cfg.task))] == ["1", "2", "3", "4"]


def test_eval_cli_names_a_missing_eval_dataset(capsys):
    assert eval_main(["--config", "configs/tiny.yaml", "eval.dataset=/nonexistent.jsonl"]) == 2
    assert "eval.dataset = '/nonexistent.jsonl' does not exist" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_run_with_eval_interval_writes_eval_rows(tmp_path, repo, python):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [python, "-m", "streamrl.launcher.launch", "--config", str(repo / "configs/tiny.yaml"), "--run-dir",
         str(run_dir), "--learners", "1", "--rollers", "1", "--steps", "30", "eval.interval=5", "eval.size=8"],
        cwd=repo, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "learner/step" in r]
    assert len(steps) == 30 and not any("eval/accuracy" in r for r in steps)  # lines never mixed
    versions = [r["eval/version"] for r in evals]
    assert len(evals) >= 2 and versions == sorted(set(versions)), versions
    assert all(r["eval/n"] == 8 and 0 <= r["eval/accuracy"] <= 1 for r in evals)
    # one evaluation per interval block: no two evaluated versions in the same block of 5
    assert len({v // 5 for v in versions}) == len(versions)
    summary = read_eval_summary(run_dir)
    assert summary["latest"] == evals[-1] and summary["evaluations"] == len(evals)
    assert summary["best"]["eval/accuracy"] == max(r["eval/accuracy"] for r in evals)
    assert (run_dir / "logs" / "evaluator.log").exists()


def _until_written(path, proc, timeout_s: float) -> None:
    """Wait until ``path`` exists; fail at once if ``proc`` exits first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the evaluator exited ({proc.returncode}) before writing {path.name}"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout_s:.0f} s"
        time.sleep(0.1)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["hf", "hf_fast"])
def test_the_evaluator_process_scores_a_published_version(tmp_path, redis_url, run_id, repo, python, engine):
    """The evaluator as the launcher starts it (its own process, a real Redis, real published weights)
    under either eval.engine: it scores version 0 (weights other than the ones it starts from) and
    writes the row to metrics.jsonl, eval.json and the Redis metrics; the row is the one
    transformers' generate gives for the published weights, and a stop ends the process cleanly."""
    from streamrl.coord.coordinator import Coordinator
    from streamrl.weights.factory import make_publisher

    run_dir = tmp_path / "run"
    overrides = [f"run.run_dir={run_dir}", "eval.interval=5", "eval.size=6", "eval.batch_size=4",
                 "eval.max_new_tokens=8"]
    cfg = load_config("configs/tiny.yaml", [*overrides, f"eval.engine={engine}"])
    coord = Coordinator(redis_url, run_id)
    coord.put_config(cfg.to_dict())
    model, tok = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
    torch.manual_seed(1)
    with torch.no_grad():  # the published version is not the model the evaluator builds at start
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    publisher = make_publisher(coord, run_id, cfg)
    with open(tmp_path / "evaluator.log", "w") as log:
        publisher.publish(0, [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()],
                          (p.detach() for _, p in model.named_parameters()))
        proc = subprocess.Popen([python, "-m", "streamrl.workers.evaluator", "--redis-url", redis_url,
                                 "--run-id", run_id], cwd=repo, stdout=log, stderr=subprocess.STDOUT)
        try:
            _until_written(run_dir / "eval.json", proc, timeout_s=180)
            coord.request_stop("test done")
            assert proc.wait(timeout=30) == 0, (tmp_path / "evaluator.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            publisher.close()
    row = read_eval_summary(run_dir)["latest"]
    assert [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [row]
    assert row["eval/version"] == 0 and row["eval/n"] == 6
    assert coord.latest_metrics()["eval"]["eval/reward_mean"] == row["eval/reward_mean"]
    hf = load_config("configs/tiny.yaml", [*overrides, "eval.engine=hf"])
    expected = evaluate_config(eval_decoder(hf, model, tok), tok, hf)
    assert {k: row[k] for k in expected} == expected
    fresh, _ = load_model_and_tokenizer(cfg.model, seed=cfg.run.seed)
    assert evaluate_config(eval_decoder(hf, fresh, tok), tok, hf) != expected  # so the row tells the weights apart


def test_truncated_responses_score_zero_when_the_task_says_so_and_are_counted(tiny):
    """The tiny random model never stops within 2 tokens: every response is cut, and counted."""
    cfg, decoder, tok = tiny
    problems = [Problem(f"{i}=", "x") for i in range(3)]
    all_right = CombinedReward(["one"], [1.0], [lambda problem, response: 1.0])
    kw = dict(chat_template=False, max_new_tokens=2)
    kept = evaluate(decoder, tok, problems, all_right, **kw)
    assert kept["eval/truncated"] == 1.0 and kept["eval/accuracy"] == 1.0  # the rule is the task's choice
    zeroed = evaluate(decoder, tok, problems, all_right, truncated_scores_zero=True, **kw)
    assert zeroed["eval/truncated"] == 1.0 and zeroed["eval/accuracy"] == 0.0


def test_held_out_families_are_scored_apart():
    """A reasoning-gym mix with a family training never sees reports it as its own set."""
    cfg = load_config(None, ["task.name=reasoning_gym", "task.answer_format=think",
                             "task.datasets={products: 1, chain_sum: {held_out: true}}", "eval.size=40"])
    held = eval_set(cfg, build_task(cfg.task))
    from streamrl.evaluate import set_accuracies

    rewards = [1.0 if p.fields["held_out_family"] else 0.0 for p in held]
    acc = set_accuracies(held, rewards)
    assert acc["eval/accuracy/held_out_families"] == 1.0 and acc["eval/accuracy/trained_families"] == 0.0
    assert acc["eval/n/held_out_families"] + acc["eval/n/trained_families"] == 40
    assert acc["eval/accuracy/chain_sum"] == 1.0


def test_eval_cli_scores_an_exported_folder_by_model(tmp_path, capsys):
    folder = tiny_llama_folder(tmp_path / "hf")
    assert eval_main(["--config", "configs/tiny.yaml", "--model", str(folder), "--json", "eval.size=3"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["model"] == str(folder) and res["eval/n"] == 3


def test_the_fast_engine_scores_like_transformers_generate(tmp_path):
    """eval.engine=hf_fast (the rollout engine, slots refilled as answers end) gives the same greedy
    answers, lengths and scores as transformers' generate on the same float32 model, with fewer
    slots than problems; and the same pass@k: near temperature 0 every sample is its problem's
    greedy answer, so a sample scored against another problem (or drawn from the wrong
    distribution) would show as pass@k or mean@k below 1."""
    folder = tiny_llama_folder(tmp_path / "hf")
    decoders, rows = {}, {}
    for engine in ("hf", "hf_fast"):
        cfg = load_config("configs/tiny.yaml", [f"model.path={folder}", f"eval.engine={engine}", "eval.size=6",
                                                "eval.batch_size=4", "rollout.max_new_tokens=12"])
        model, tok = load_model_and_tokenizer(cfg.model, seed=0)
        decoders[engine] = decoder = eval_decoder(cfg, model, tok)
        prompts = [tok.encode(f"{i} + {i} =") for i in range(6)]
        rows[engine] = (decoder.generate(prompts, 12), evaluate_config(decoder, tok, cfg))
    assert rows["hf_fast"] == rows["hf"]

    # the random model repeats a prompt's last character: six problems, six different greedy answers
    problems = [Problem(p, "") for p in ("abc", "xyz", "hello", "7", "000", "111")]
    greedy = [response_texts(tok, g)[0] for g in decoders["hf"].generate([tok.encode(p.prompt) for p in problems], 12)]
    assert len(set(greedy)) == len(problems)
    answer = dict(zip((p.prompt for p in problems), greedy))
    its_own = CombinedReward(["greedy"], [1.0], [lambda problem, response: float(response == answer[problem.prompt])])
    kw = dict(chat_template=False, max_new_tokens=12, batch_size=4, samples=3, temperature=1e-4)
    scored = {engine: evaluate(d, tok, problems, its_own, **kw) for engine, d in decoders.items()}
    fast = scored["hf_fast"]
    assert fast == scored["hf"] and fast["eval/accuracy"] == fast["eval/pass@3"] == fast["eval/mean@3"] == 1.0


def test_eval_engine_is_checked_by_name():
    with pytest.raises(ValueError, match=r"eval\.engine.*'vllm'.*must be one of"):
        load_config(None, ["eval.engine=vllm"])


def test_one_fast_scorer_serves_many_folders_as_fresh_ones_would(tmp_path):
    """The race's scorer keeps one hf_fast engine and copies each folder's weights into it: after a
    second folder (other weights) it answers exactly as an engine built for that folder alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.bench.race_curve import FolderScorer

    first = tiny_llama_folder(tmp_path / "a")
    other = AutoModelForCausalLM.from_pretrained(first)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5 * torch.randn_like(p))
    other.save_pretrained(tmp_path / "b")
    AutoTokenizer.from_pretrained(first).save_pretrained(tmp_path / "b")
    overrides = ["eval.engine=hf_fast", "eval.size=6", "eval.batch_size=4", "rollout.max_new_tokens=12"]
    cfg = load_config("configs/tiny.yaml", [f"model.path={first}", *overrides])
    shared = FolderScorer(cfg, "cpu")
    rows = [shared(first), shared(tmp_path / "b")]
    engine = shared.decoder
    assert rows[1] == FolderScorer(cfg, "cpu")(tmp_path / "b") and shared.decoder is engine

    cfg_b = load_config("configs/tiny.yaml", [f"model.path={tmp_path / 'b'}", *overrides])
    model_b, tok = load_model_and_tokenizer(cfg_b.model, seed=0)
    model_a, _ = load_model_and_tokenizer(cfg.model, seed=0)

    def answers(decoder):
        return decoder.generate([tok.encode(f"{i} + 1 =") for i in range(4)], 12)

    assert answers(engine) == answers(eval_decoder(cfg_b, model_b, tok))
    assert answers(engine) != answers(eval_decoder(cfg, model_a, tok))  # the copy took
