"""streamrl-bench race: both sides train a tiny HF model for a wall-clock budget and one evaluator
scores every export; the curve maths (time to an accuracy, the ratio's rules)."""
from __future__ import annotations

import json
import math

import pytest

from streamrl.bench import race
from streamrl.bench.race_curve import check_same_setup, compare, curve_fields, time_to_accuracy
from tests.model_helpers import tiny_llama_folder

pytest.importorskip("trl")



def pt(t, acc, n=100):
    return {"time_s": t, "accuracy": acc, "stderr": math.sqrt(acc * (1 - acc) / n)}


def test_time_to_accuracy_interpolates_and_the_ratio_follows_its_rules():
    peer = [pt(0, 0.1), pt(100, 0.2), pt(200, 0.3), pt(300, 0.3), pt(400, 0.4)]
    fast = [pt(0, 0.1), pt(50, 0.3), pt(100, 0.5), pt(150, 0.6), pt(200, 0.6)]
    assert time_to_accuracy(peer, 0.4) == 400
    assert time_to_accuracy(fast, 0.4) == pytest.approx(75.0)  # halfway between 0.3 at 50 s and 0.5 at 100 s
    res = compare(fast, peer)
    assert res["time_to_peer_final_accuracy_ratio"] == pytest.approx(400 / 75)
    assert res["streamrl_reached_peer_final"] and res["streamrl_ends_above_peer"]
    slow = [pt(0, 0.1), pt(400, 0.2)]
    res = compare(slow, peer)  # never reached: no ratio, said so
    assert res["time_to_peer_final_accuracy_ratio"] is None and not res["streamrl_reached_peer_final"]
    flat = [pt(0, 0.1), pt(400, 0.1)]
    res = compare(fast, flat)  # the peer learned nothing: nothing to race for
    assert res["time_to_peer_final_accuracy_ratio"] is None and not res["peer_improved"]


def test_curve_fields_give_each_held_out_set_its_stderr():
    row = {"eval/accuracy": 0.5, "eval/n": 100, "eval/accuracy/held_out_families": 0.25,
           "eval/n/held_out_families": 20, "eval/accuracy/chain_sum": 0.25, "eval/truncated": 0.1}
    f = curve_fields(row)
    assert f["stderr"] == pytest.approx(0.05)
    assert f["sets"]["held_out_families"] == {"accuracy": 0.25, "stderr": pytest.approx(math.sqrt(0.25 * 0.75 / 20)),
                                              "n": 20}
    assert f["sets"]["chain_sum"]["stderr"] is None and f["truncated"] == 0.1


def test_check_same_setup_names_the_field_and_tolerates_older_jsons():
    a = {"model": "0123", "tokenizer": {"eos": "<|im_end|>", "chat_template": "abcd"}, "device": "NVIDIA H100"}
    assert check_same_setup({"streamrl": a, "peer": dict(a)}) == []
    assert check_same_setup({"streamrl": a, "peer": None}) == ["peer"]  # recorded before setups were: unchecked
    with pytest.raises(ValueError, match=r"different setups: tokenizer .*chat_template.*None"):
        check_same_setup({"streamrl": a, "peer": {**a, "tokenizer": {"eos": "<|im_end|>", "chat_template": None}}})


def test_combine_names_a_missing_side(tmp_path, capsys):
    assert race.main(["--combine", str(tmp_path)]) == 2
    assert "no streamrl.json (run --side streamrl" in capsys.readouterr().err


def test_score_phase_names_a_side_not_trained(tmp_path, repo, capsys):
    args = ["--config", str(repo / "configs/tiny.yaml"), "--out", str(tmp_path), "--side", "peer", "--phase", "score",
            f"model.path={tmp_path}"]
    assert race.main(args) == 2
    assert f"no {tmp_path / 'peer-exports.json'} (run --side peer --phase train" in capsys.readouterr().err


def test_a_folder_whose_tokenizer_lost_its_specials_or_template_is_refused_before_training(tmp_path, repo, capsys):
    model = tiny_llama_folder(tmp_path / "model")
    args = ["--config", str(repo / "configs/tiny.yaml"), "--out", str(tmp_path / "race"), f"model.path={model}"]
    assert race.main([*args, "rollout.chat_template=true"]) == 2
    assert "rollout.chat_template = true but its tokenizer has no chat template" in capsys.readouterr().err
    cfg_file = model / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    tok_cfg["eos_token"] = None
    cfg_file.write_text(json.dumps(tok_cfg))
    assert race.main(args) == 2
    assert "its tokenizer has no end-of-sequence token" in capsys.readouterr().err
    assert not (tmp_path / "race").exists()  # refused before any side ran


def test_race_runs_both_sides_and_scores_them_with_one_evaluator(tmp_path, repo, capsys):
    """Both sides of a tiny race (StreamRL in one invocation, the peer as --phase train then --phase
    score, as on the GPU), then --combine: every point is a real score."""
    model = tiny_llama_folder(tmp_path / "model")
    out = tmp_path / "race"
    common = ["--config", str(repo / "configs/tiny.yaml"), "--out", str(out), "--budget-s", "40", "--device", "cpu",
              "--export-every", "2", f"model.path={model}", "eval.size=16", "rollout.max_new_tokens=6",
              "learner.groups_per_step=4", "rollout.group_size=4"]
    assert race.main([*common, "--side", "streamrl"]) == 0
    assert race.main([*common, "--side", "peer", "--phase", "train"]) == 0
    assert not (out / "peer.json").exists() and (out / "peer-exports.json").is_file()
    assert race.main([*common, "--side", "peer", "--phase", "score"]) == 0
    assert race.main(["--combine", str(out), "--json"]) == 0
    res = json.loads((out / "race.json").read_text())
    assert (out / "race.png").stat().st_size > 0
    for side in ("streamrl", "peer"):
        curve = res[side]
        assert [p["fraction"] for p in curve] == [0.0, 0.25, 0.5, 0.75, 1.0]
        times = [p["time_s"] for p in curve]
        assert times == sorted(times)
        for p in curve:
            assert p["n"] == 16 and 0 <= p["accuracy"] <= 1
            assert p["accuracy"] * 16 == pytest.approx(round(p["accuracy"] * 16))  # a share of 16 real scores
            assert p["stderr"] == pytest.approx(math.sqrt(p["accuracy"] * (1 - p["accuracy"]) / 16))
    assert res["streamrl"][0]["accuracy"] == res["peer"][0]["accuracy"]  # one evaluator, the same base model
    assert res["peer"][-1]["step"] > 0  # the peer trained
    # StreamRL stops at the budget; the peer's step is not cut, so it stops at the first step end
    # that would overrun it (its first step on a busy 2-core machine can end past the budget)
    assert res["streamrl"][-1]["time_s"] == pytest.approx(40, abs=2)
    assert "time_to_peer_final_accuracy_ratio" in res and res["budget_s"] == 40
    setup = res["setup"]
    assert setup["device"] == "cpu" and len(setup["model"]) == len(setup["held_out"]) == 16
    # a side scored on another setup (here another transformers release) is refused, naming what differs
    peer = json.loads((out / "peer.json").read_text())
    peer["setup"]["versions"]["transformers"] = "0.0"
    (out / "peer.json").write_text(json.dumps(peer))
    capsys.readouterr()
    assert race.main(["--combine", str(out)]) == 2
    assert "different setups: versions" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_race_on_smollm2_scores_both_curves(tmp_path, repo):
    """A longer race on the real model (configs/race-cpu.yaml), both sides in one invocation."""
    if not (repo / "models/smol/config.json").is_file():
        pytest.skip("models/smol not prepared (streamrl-prepare-model --out models/smol --experts 0)")
    out = tmp_path / "race"
    assert race.main(["--config", str(repo / "configs/race-cpu.yaml"), "--out", str(out), "--budget-s", "240",
                      "--device", "cpu", f"model.path={repo / 'models/smol'}", "eval.size=48"]) == 0
    res = json.loads((out / "race.json").read_text())
    for side in ("streamrl", "peer"):
        assert len(res[side]) == 5 and res[side][-1]["samples"] > 0
        assert "held_out_families" in res[side][-1]["sets"]
    assert res["streamrl"][0] == {**res["peer"][0]}  # the base model, scored by the one evaluator


def test_compare_reports_the_never_trained_families_base_vs_final():
    fam = lambda a: {"held_out_families": {"accuracy": a, "stderr": 0.05, "n": 40}}  # noqa: E731
    ours = [{**pt(0, 0.1), "sets": fam(0.1)}, {**pt(100, 0.4), "sets": fam(0.3)}]
    peer = [{**pt(0, 0.1), "sets": fam(0.1)}, {**pt(100, 0.2), "sets": fam(0.15)}]
    res = compare(ours, peer)
    assert res["streamrl_held_out_families"]["gain"] == pytest.approx(0.2)
    assert res["peer_held_out_families"]["final"] == 0.15
    assert "streamrl_held_out_families" not in compare([pt(0, 0.1), pt(1, 0.2)], [pt(0, 0.1), pt(1, 0.2)])


def _race_json(folder, ratio, gap, gap_se=0.03, budget=360.0):
    folder.mkdir()
    (folder / "race.json").write_text(json.dumps({
        "budget_s": budget, "time_to_peer_final_accuracy_ratio": ratio, "final_accuracy_gap": gap,
        "final_accuracy_gap_stderr": gap_se, "streamrl_ends_above_peer": gap > gap_se, "peer_final_accuracy": 0.12}))
    return str(folder)


def test_summarize_gives_the_median_and_spread_over_pairs(tmp_path, capsys):
    dirs = [_race_json(tmp_path / "s0", 3.65, 0.168), _race_json(tmp_path / "s1", 2.5, 0.02),
            _race_json(tmp_path / "s2", None, -0.01)]
    assert race.main(["--summarize", *dirs, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the pair StreamRL never finished counts as ratio 0: the median is the middle of 0, 2.5, 3.65
    assert (out["ratio_median"], out["ratio_min"], out["ratio_max"]) == (2.5, 0.0, 3.65)
    assert out["final_gap_median"] == 0.02 and out["pairs_ending_above"] == 1
    assert out["pairs_without_ratio"] == [dirs[2]]
    assert race.main(["--summarize", dirs[0], str(tmp_path / "none")]) == 2
    assert "no " + str(tmp_path / "none" / "race.json") in capsys.readouterr().err
    other = _race_json(tmp_path / "s3", 3.0, 0.1, budget=240.0)
    assert race.main(["--summarize", dirs[0], other]) == 2
    assert "different budgets" in capsys.readouterr().err
