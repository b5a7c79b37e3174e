"""The GPU acceptance rows of issue 19 (``benchmarks/acceptance.py``, groups sft, lora and muon) are
command lines flame's config manager accepts, compared at equal tokens per step; no run."""

import importlib.util
import os
import subprocess
import sys

import pytest

from flame.config.manager import FlameConfigManager
from tests.trainer.helpers import ROOT


def _acceptance():
    spec = importlib.util.spec_from_file_location("acceptance", os.path.join(ROOT, "benchmarks/acceptance.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


acceptance = _acceptance()
ROWS = {r.name: r for r in acceptance.all_rows(20)}
GROUPS = ("sft", "lora", "muon")


def _job(row, tmp_path):
    return FlameConfigManager().parse_args([*row.args, "--job.dump_folder", str(tmp_path / row.name)])


def _tokens_per_step(job) -> int:
    t = job.training
    return t.batch_size * t.seq_len * t.gradient_accumulation_steps


@pytest.mark.parametrize("name", [n for n, r in ROWS.items() if r.group in GROUPS])
def test_the_row_parses(name, tmp_path):
    row = ROWS[name]
    job = _job(row, tmp_path)
    assert job.training.steps == row.steps
    assert os.path.isfile(job.model.config)
    if row.reference:
        assert ROWS[row.reference].group == row.group
    if row.plot_with:
        assert ROWS[row.plot_with].group == row.group


def test_lora_rows_compare_offload_with_the_resident_run_at_equal_tokens(tmp_path):
    resident, offloaded = (_job(ROWS[n], tmp_path) for n in ("lora_8B_resident", "lora_8B_offload"))
    assert resident.lora.rank == offloaded.lora.rank == 16
    assert resident.offload.enable == "off" and offloaded.offload.enable == "on"
    assert offloaded.offload.gpu_memory_gib == 16
    assert resident.model.config.endswith("benchmarks/configs/llama3_8B.json") and resident.model.config == offloaded.model.config
    assert _tokens_per_step(resident) == _tokens_per_step(offloaded)
    # the resident run recomputes every block; the offload planner chooses per block
    assert resident.activation_checkpoint.mode == "full" and offloaded.activation_checkpoint.mode == "none"
    assert resident.training.compile and offloaded.training.compile
    assert ROWS["lora_8B_offload"].reference == "lora_8B_resident"


def test_muon_rows_differ_only_in_the_optimizer(tmp_path):
    adamw, muon = ROWS["muon_adamw_340M"], ROWS["muon_340M"]
    assert _job(adamw, tmp_path).optimizer.name == "AdamW" and _job(muon, tmp_path).optimizer.name == "Muon"
    differ = [(a, b) for a, b in zip(adamw.args, muon.args) if a != b]
    assert len(adamw.args) == len(muon.args) and differ == [("AdamW", "Muon")]
    assert muon.steps >= 200 and muon.plot_with == adamw.name


def test_the_table_prints_each_ratio_against_its_reference():
    rows = [ROWS[n] for n in ("muon_adamw_340M", "muon_340M", "lora_8B_resident", "lora_8B_offload")]
    results = [{"row": "muon_adamw_340M", "exit": 0, "tokens_per_second": 200_000,
                "loss_curve": [[1, 10.5], [2, 9.0], [3, 8.0]]},
               {"row": "muon_340M", "exit": 0, "tokens_per_second": 170_000, "loss_curve": [[1, 10.5], [2, 9.25]]},
               {"row": "lora_8B_resident", "exit": 0, "tokens_per_second": 12_000},
               {"row": "lora_8B_offload", "exit": "not run", "tokens_per_second": 11_000}]
    # a row that did not pass (here: cut by the call's budget) has no ratio, whatever speed it reached
    got = acceptance.ratios(rows, results)
    assert got == [{"row": "muon_340M", "reference": "muon_adamw_340M", "ratio": 0.85, "target_ratio": 0.9, "met": False,
                    "loss_max_abs_diff": 0.25}]
    doc = {"device": {"name": "cpu", "count": 0}, "versions": {}, "commit": "x" * 10, "date": "2026-11-26",
           "steps": 20, "results": [], "ratios": got, "plots": ["/out/acceptance_t_muon_340M.png"]}
    md = acceptance.markdown(doc)
    assert "- muon_340M: 0.85x the tokens/s of muon_adamw_340M (-15%; target >= 0.9x, NOT met)" in md
    assert "- plot: acceptance_t_muon_340M.png" in md


def test_the_muon_pair_is_drawn_next_to_the_result(tmp_path):
    import json

    results = []
    for name, losses in (("muon_adamw_340M", [10.5, 9.0, 8.0]), ("muon_340M", [10.5, 8.5, 7.5])):
        dump = tmp_path / name
        dump.mkdir()
        (dump / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n"
                                                    for i, v in enumerate(losses)))
        results.append({"row": name, "dump": str(dump)})
    rows = [ROWS["muon_adamw_340M"], ROWS["muon_340M"]]
    written = acceptance.plot_pairs(rows, results, str(tmp_path / "acceptance_t.json"))
    assert len(written) == 1 and os.path.basename(written[0]).startswith("acceptance_t_muon_340M.")
    assert os.path.getsize(written[0]) > 0
    # a pair with a dump missing draws nothing
    assert acceptance.plot_pairs(rows, results[1:], str(tmp_path / "other.json")) == []


def test_gpu_slots_give_each_row_its_own_gpu_when_there_are_enough(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")
    assert acceptance.gpu_slots(4) == (["2", "3", "5", "7"], 1)
    assert acceptance.gpu_slots(2) == (["2", "3"], 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4")
    assert acceptance.gpu_slots(3) == (["4", "4", "4"], 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert acceptance.gpu_slots(2) == ([None, None], 2)


def test_status_takes_each_rows_latest_run_over_result_files(tmp_path):
    """--status: a later file's result replaces an earlier one, a later "not run" does not; rows
    no file ran are counted as never run."""
    import json

    def doc(date, commit, results):
        return {"date": date, "commit": commit, "device": {"name": "GPU", "count": 1}, "results": results}

    row = lambda name, exit_, tps=None: {"row": name, "exit": exit_, "tokens_per_second": tps, "peak_reserved_gib": 1.0,
                                         "loss_first": 2.0, "loss_last": 1.0}
    early = doc("2026-01-01", "aaaaaaa", [row("flame_readme", 0, 100), row("paper_sdpa", 0, 50)])
    late = doc("2026-01-02", "bbbbbbb", [row("flame_readme", 1), {"row": "paper_sdpa", "exit": "not run", "reason": "x"}])
    paths = []
    for name, d in (("late.json", late), ("early.json", early)):  # file order is not date order
        paths.append(str(tmp_path / name))
        with open(paths[-1], "w") as f:
            json.dump(d, f)
    rows = [ROWS["flame_readme"], ROWS["paper_sdpa"], ROWS["paper_vanilla"]]
    text = acceptance.status(paths, rows)
    assert text.splitlines()[0] == "1 pass, 1 fail, 1 never run of 3 rows"
    lines = {l.split(" | ")[0].strip("| "): l for l in text.splitlines() if l.startswith("| ") and "---" not in l}
    assert "| 1 |" in lines["flame_readme"] and "bbbbbbb" in lines["flame_readme"]
    assert "| 50 |" in lines["paper_sdpa"] and "early.json" in lines["paper_sdpa"]
    assert "never run" in lines["paper_vanilla"]
    # a row with a speed target passes only where its latest file's ratio met it
    target = ROWS["paper_softpick"]
    for met, counted in ((True, "1 pass, 0 fail"), (False, "0 pass, 1 fail")):
        d = doc("2026-01-03", "ccccccc", [row("paper_softpick", 0, 90), row("paper_sdpa", 0, 100)])
        d["ratios"] = [{"row": "paper_softpick", "reference": "paper_sdpa", "ratio": 0.9, "target_ratio": 0.9, "met": met}]
        with open(tmp_path / "target.json", "w") as f:
            json.dump(d, f)
        text = acceptance.status([str(tmp_path / "target.json")], [target])
        assert text.splitlines()[0].startswith(counted), text
        assert ("under its 0.9x target" in text) is not met


def test_a_row_cut_by_the_calls_budget_is_not_run_and_one_at_its_own_cap_timed_out():
    """A timeout under a cap shortened by the call's budget says nothing of the row (recorded as
    not run, which the status table passes over); one at the row's own cap is a failure."""
    timed_out = {"row": "r", "exit": "timeout", "wall_s": 200.0, "steps_logged": 0}
    cut = acceptance.cut_by_budget(timed_out, 540, 200)
    assert cut["exit"] == "not run" and "200 s of its 540 s cap" in cut["reason"] and cut["wall_s"] == 200.0
    assert acceptance.cut_by_budget(timed_out, 540, 540)["exit"] == "timeout"
    assert acceptance.cut_by_budget(timed_out, 540, 539.99)["exit"] == "timeout"
    assert acceptance.cut_by_budget({"row": "r", "exit": 0}, 540, 200)["exit"] == 0
    assert acceptance.cut_by_budget({"row": "r", "exit": 1}, 540, 200)["exit"] == 1


@pytest.mark.parametrize("cap_s,left_s", [(540, 425), (300, 1000), (540, 70), (600, 600)])
def test_a_row_and_its_exit_wait_end_within_the_calls_budget(cap_s, left_s):
    """A row killed at its cap still returns (and its result is written) before the budget ends:
    the wait for its processes to exit is counted in the budget."""
    cap, wait = acceptance.row_time(cap_s, left_s)
    assert 0 < cap <= cap_s and cap + wait <= left_s and wait >= 5
    if left_s - cap_s > acceptance.GROUP_EXIT_WAIT_S + 10:
        assert (cap, wait) == (cap_s, acceptance.GROUP_EXIT_WAIT_S)


def test_a_killed_group_is_waited_for_no_longer_than_asked(tmp_path):
    """A row over its cap: its whole process group (a shell and its child) is killed, and
    run_in_group returns "timeout" within the cap and the exit wait."""
    import time

    t = time.perf_counter()
    rc, wall, _ = acceptance.run_in_group(["sh", "-c", "sleep 60 & sleep 60"], dict(os.environ),
                                          str(tmp_path / "log"), cap_s=1.0, exit_wait_s=2.0)
    assert rc == "timeout" and wall < 5 and time.perf_counter() - t < 8


def test_a_row_stopped_at_its_cap_reports_where_its_threads_were():
    """The stacks that faulthandler printed before the kill are the row's `stacks_at_timeout`,
    whatever prefix the launcher put on each line; a log without them gives None."""
    log = ("[rank0]: step 1\n[rank0]:Thread 0x00007f01 (most recent call first):\n"
           '[rank0]:  File "a.py", line 3 in wait\n[rank0]:Current thread 0x00007f02 (most recent call first):\n')
    stacks = acceptance.dumped_stacks(log)
    assert stacks.startswith("[rank0]:Thread 0x00007f01") and "a.py" in stacks and "step 1" not in stacks
    assert acceptance.dumped_stacks("[rank0]: step 1\n") is None
    assert acceptance.dumped_stacks(log, limit=20).endswith("...")


def test_stacks_are_also_read_from_the_workers_own_stderr_files(tmp_path):
    """When the console lost the dump (the kill cut the launcher's pipe), the rank's stderr file
    under the run's logs folder still has it."""
    rank = tmp_path / "logs" / "run-id" / "attempt_0" / "0"
    rank.mkdir(parents=True)
    (rank / "stderr.log").write_text('loading\nThread 0x00007f01 (most recent call first):\n  File "b.py", line 9 in time_block\n')
    stacks = acceptance.dumped_stacks(acceptance.rank_stderr(str(tmp_path)))
    assert stacks.startswith("Thread 0x00007f01") and "time_block" in stacks
    assert acceptance.rank_stderr(str(tmp_path / "elsewhere")) == ""


def test_the_seeded_pair_shares_one_seed_and_its_commands_parse(tmp_path):
    """config_transformer_1B and its offloaded twin name one seed; the seed's command (the row's
    without offload, making the step-0 checkpoint only) and each seeded row parse."""
    pair = [ROWS["config_transformer_1B"], ROWS["config_transformer_1B_offload"]]
    assert {r.seed for r in pair} == {acceptance.PAIR_SEED} and sum(bool(r.seed) for r in ROWS.values()) == 2
    folder = str(tmp_path / "seed")
    seed = FlameConfigManager().parse_args(acceptance.seed_args(pair[1], folder))
    assert seed.checkpoint.create_seed_checkpoint and seed.checkpoint.enable_checkpoint
    assert seed.offload.enable == "off" and seed.job.dump_folder == folder
    for r in pair:
        args = acceptance.seeded(list(r.args), "/x/step-0") + ["--job.dump_folder", str(tmp_path / r.name)]
        cfg = FlameConfigManager().parse_args(args)
        assert cfg.checkpoint.initial_load_path == "/x/step-0" and cfg.checkpoint.last_save_model_only
        assert (cfg.offload.enable == "on") == r.name.endswith("_offload")


@pytest.mark.slow
def test_rows_naming_one_seed_start_from_its_weights(tmp_path):
    """Two tiny CPU rows, plain and offloaded, naming one seed: the seed is made once, both load
    it, and their losses agree (the engine computing in float32 like the plain job)."""
    from tests.trainer.helpers import tiny_job
    from tests.trainer.test_offload_training import OFFLOAD

    base = tiny_job(str(tmp_path / "unused"), "--training.steps", "3", "--checkpoint.no-enable-checkpoint")
    plain = acceptance.Row("tiny_plain", "t", "tiny", base, 3, 240, seed="tiny")
    off = acceptance.Row("tiny_offload", "t", "tiny", base + [*OFFLOAD, "--offload.compute_dtype", "float32"], 3, 240,
                         seed="tiny")
    runs = str(tmp_path / "runs")
    results = [acceptance.run_row(r, runs, 240) for r in (off, plain)]  # the offloaded row makes the seed
    assert [r["exit"] for r in results] == [0, 0], results
    step0 = os.path.join(runs, "seed_tiny", "checkpoint", "step-0")
    for r in results:
        with open(os.path.join(r["dump"], "console.log")) as f:
            assert f"Loading the checkpoint from {step0}" in f.read()
    curves = [[loss for _, loss in r["loss_curve"]] for r in results]
    assert len(curves[0]) == 3 and curves[0] == pytest.approx(curves[1], rel=1e-5, abs=1e-5)


def test_rows_still_to_pass_keep_their_references_and_run_longest_first(tmp_path):
    """--not_passed_in: rows that passed in the given files are left out, a row still to pass
    brings its reference row (ratios compare rows of one call); --longest_first orders by the
    latest wall time there, rows never timed first."""
    import json

    results = [{"row": "paper_sdpa", "exit": 0, "wall_s": 90.0}, {"row": "paper_softpick", "exit": 1, "wall_s": 30.0},
               {"row": "paper_vanilla", "exit": 0, "wall_s": 70.0}, {"row": "flame_readme", "exit": "timeout",
                                                                      "wall_s": 400.0}]
    path = str(tmp_path / "r.json")
    with open(path, "w") as f:
        json.dump({"date": "2026-01-01", "results": results}, f)
    # a later file: paper_rectified passed but missed its target ratio, which keeps it to do
    later = [{"row": "paper_sdpa", "exit": 0, "wall_s": 90.0}, {"row": "paper_rectified", "exit": 0, "wall_s": 80.0}]
    ratios = [{"row": "paper_rectified", "reference": "paper_sdpa", "ratio": 0.89, "target_ratio": 0.9, "met": False}]
    path2 = str(tmp_path / "r2.json")
    with open(path2, "w") as f:
        json.dump({"date": "2026-01-02", "results": later, "ratios": ratios}, f)
    assert [r.name for r in acceptance.still_to_pass([ROWS["paper_rectified"]], [path, path2], list(ROWS.values()))] \
        == ["paper_sdpa", "paper_rectified"]
    ratios[0]["met"] = True
    with open(path2, "w") as f:
        json.dump({"date": "2026-01-02", "results": later, "ratios": ratios}, f)
    assert acceptance.still_to_pass([ROWS["paper_rectified"]], [path, path2], list(ROWS.values())) == []
    every = list(ROWS.values())
    chosen = [ROWS[n] for n in ("paper_vanilla", "paper_softpick", "flame_readme", "paper_rectified")]
    todo = acceptance.still_to_pass(chosen, [path], every)
    # paper_softpick failed and paper_rectified never ran: both need paper_sdpa, which passed
    assert [r.name for r in todo] == ["paper_sdpa", "paper_softpick", "flame_readme", "paper_rectified"]
    order = acceptance.longest_first(todo, [path])
    assert [r.name for r in order] == ["paper_rectified", "flame_readme", "paper_sdpa", "paper_softpick"]


def test_step_profile_summary_sums_gpu_time_by_category():
    """``benchmarks/step_profile.py``: kernels, copies and fills by category and name; the GPU's
    busy time is the union of its intervals (overlapping streams counted once)."""
    spec = importlib.util.spec_from_file_location("step_profile", os.path.join(ROOT, "benchmarks/step_profile.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    events = [
        {"ph": "X", "name": "ProfilerStep#4", "cat": "user_annotation", "ts": 0, "dur": 1000},
        {"ph": "X", "name": "attn_bwd_dkdv_kernel", "cat": "kernel", "ts": 100, "dur": 300},
        {"ph": "X", "name": "nvjet_sm90_tst_256x128", "cat": "kernel", "ts": 300, "dur": 200},  # overlaps 100 us
        {"ph": "X", "name": "triton_poi_fused_add_0", "cat": "kernel", "ts": 600, "dur": 50},
        {"ph": "X", "name": "Memcpy HtoD (Pinned -> Device)", "cat": "gpu_memcpy", "ts": 700, "dur": 100},
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 900},  # host side: not GPU time
    ]
    s = module.summarize({"traceEvents": events})
    assert s["step_wall_ms"] == 1.0
    assert s["by_category_ms"] == {"flame_attention": 0.3, "gemm": 0.2, "copy_or_fill": 0.1, "inductor_fused": 0.05}
    assert s["gpu_kernel_sum_ms"] == 0.65 and s["gpu_busy_ms"] == 0.55 and s["gpu_span_ms"] == 0.7
    assert [k["name"] for k in s["top_kernels"]][:2] == ["attn_bwd_dkdv_kernel", "nvjet_sm90_tst_256x128"]


def test_rows_with_a_speed_target_run_long_enough_for_a_steady_median():
    rows = {r.name: r for r in acceptance.all_rows(8)}
    targeted = {"flame_readme", "paper_softpick", "paper_rectified", "paper_sdpa"}
    assert {rows[n].reference for n in targeted if rows[n].target_ratio} == {"paper_sdpa"}
    for name in targeted:
        row = rows[name]
        given = row.args[row.args.index("--training.steps") + 1]
        assert row.steps >= acceptance.TARGET_MIN_STEPS and given == str(row.steps), (name, row.steps, given)
    assert rows["paper_vanilla"].steps == 8  # the others keep --steps


def test_commit_names_the_files_that_ran(tmp_path, monkeypatch):
    """HEAD while the files are HEAD's; a working tree that differs from it (as the device's copy,
    which carries another commit's .git) gets the tree hash that the commit holding it has."""
    monkeypatch.delenv("FLAME_COMMIT", raising=False)

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    head = git("rev-parse", "HEAD")
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "w.whl").write_text("wheel")
    assert acceptance.commit(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    ran = acceptance.commit(str(tmp_path))
    git("add", "-A")
    git("commit", "-qm", "two")
    assert ran == f"{head}+tree {git('rev-parse', 'HEAD^{tree}')}"
    assert git("status", "--porcelain") == ""  # the index of the checkout was not touched
