"""The pure parts of bench/peer_grpo.py and bench/peer_grpo_trl.py, without TRL: the hyper-parameter mapping, the
metrics layout the readers take, the reward service over a socket pair, the step-cost ratios and the interleaved
generation timing."""

import json
import os
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from bench import accuracy_curves, accuracy_runs, run_costs
from bench import peer_grpo as peer
from bench import peer_grpo_trl as trl_side
from megatron_dppo.algo.losses import AGGREGATIONS
from megatron_dppo.data.tokenizer import CharTokenizer
from megatron_dppo.launch.arguments import parse_args
from megatron_dppo.metrics import load_run, plot_runs
from megatron_dppo.pipeline.tasks import Prompt, Task

REPO = Path(__file__).resolve().parents[1]


def grpo_args(tmp_path, *extra: str):
    """Our parsed flags of time_to_accuracy's GRPO run (seed 3), with `extra` flags appended."""
    settings = accuracy_runs.parse_args(["--out-dir", str(tmp_path), "--methods", "grpo", "--seeds", "3"])
    return parse_args([*accuracy_runs.rl_flags(settings, "grpo", 3, tmp_path / "warm_start"), *extra])


def test_trl_config_mirrors_the_time_to_accuracy_grpo_run(tmp_path):
    args = grpo_args(tmp_path)
    config = peer.trl_config(args, max_steps=40, output_dir=str(tmp_path / "trl"))
    completions = args.rollout_batch_size * args.n_samples_per_prompt
    expected = {
        # one generation batch of B prompts x G samples per optimizer step, one update per batch
        "per_device_train_batch_size": completions, "generation_batch_size": completions,
        "gradient_accumulation_steps": 1, "num_generations": args.n_samples_per_prompt, "num_iterations": 1,
        "learning_rate": args.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "optim": "adamw_torch",
        "adam_beta1": args.adam_beta1, "adam_beta2": args.adam_beta2, "adam_epsilon": args.adam_eps,
        "weight_decay": args.weight_decay, "max_grad_norm": args.clip_grad,
        "temperature": args.rollout_temperature, "top_p": args.rollout_top_p, "top_k": 0,
        "max_completion_length": args.rollout_max_response_len,
        "loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.0, "entropy_coef": 0.0,
        "scale_rewards": "group", "importance_sampling_level": "token",
        # TRL's defaults that would differ from our run: bf16, activation recompute, shuffled prompts
        "bf16": False, "fp16": False, "gradient_checkpointing": False, "shuffle_dataset": False,
        "seed": 3, "max_steps": 40, "use_cpu": True, "logging_steps": 1,
    }
    assert {key: config[key] for key in expected} == expected
    rl_flags = accuracy_runs.RL_FLAGS  # the benchmark's GRPO settings (its --tune-grpo best)
    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.lr) == tuple(
        kind(accuracy_runs.flag_value(rl_flags, flag)) for kind, flag in (
            (int, "--rollout-batch-size"), (int, "--n-samples-per-prompt"), (float, "--lr")))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_every_loss_aggregation_maps_to_trls_loss_with_the_same_normaliser(tmp_path, aggregation):
    args = grpo_args(tmp_path, "--loss-agg-mode", aggregation)
    expected = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
    assert peer.trl_config(args, 1, "out")["loss_type"] == expected[aggregation]


def test_each_mapped_row_is_what_the_config_holds(tmp_path):
    """The printed mapping and the config the peer runs with come from the same rows."""
    args = grpo_args(tmp_path, "--lr-warmup-iters", "5", "--advantage-estimator", "dr_grpo")
    config = peer.trl_config(args, 1, "out")
    for setting in peer.trl_settings(args):
        assert {key: config[key] for key in setting.trl} == setting.trl, setting.ours
    assert (config["lr_scheduler_type"], config["warmup_steps"], config["scale_rewards"]) == \
        ("constant_with_warmup", 5, "none")


@pytest.mark.parametrize("flags, named", [
    (["--algorithm", "dppo"], "--algorithm dppo"),
    (["--kl-coef", "0.01"], "--kl-coef"),
    (["--entropy-coef", "0.01"], "--entropy-coef"),
    (["--eps-clip-c", "3"], "--eps-clip-c"),
    (["--advantage-estimator", "rloo"], "--advantage-estimator rloo"),
    (["--dapo-oversample", "2"], "--dapo-oversample"),
    (["--async"], "--async"),
    (["--lr-decay-style", "cosine"], "--lr-decay-style cosine"),
])
def test_settings_trl_cannot_mirror_are_refused_naming_the_flag(tmp_path, flags, named):
    # rl_flags ends with --algorithm grpo's flags; a later --algorithm overrides it
    args = grpo_args(tmp_path, *flags)
    with pytest.raises(ValueError, match=named.replace("-", r"\-")):
        peer.trl_settings(args)


def test_completion_up_to_eos_keeps_the_stop_token_and_drops_padding():
    assert trl_side.completion_up_to_eos([5, 6, 2, 0, 0], {2}, 0) == [5, 6, 2]
    assert trl_side.completion_up_to_eos([5, 6, 7, 0, 0], {2}, 0) == [5, 6, 7]  # truncated: no stop token
    assert trl_side.completion_up_to_eos([2, 9], {2}, 0) == [2]


def peer_records(tmp_path: Path) -> Path:
    """A peer run of two steps written with peer_step_record, plus its summary."""
    run_dir = tmp_path / "runs" / "trl-peer" / "seed_1"
    run_dir.mkdir(parents=True)
    phases = {"seconds_rollout": 0.2, "seconds_reward": 0.01, "seconds_experience": 0.25}
    first = trl_side.peer_step_record(1, 0.5, 0.5, phases, rewards=[1, 0, 0, 0, 1, 1, 1, 1],
                                  completion_lengths=[3, 4, 5, 6, 3, 3, 3, 3], prompt_lengths=[10] * 8, group=4)
    second = trl_side.peer_step_record(2, 1.1, 0.4, phases, rewards=[0] * 8, completion_lengths=[8] * 8,
                                   prompt_lengths=[12] * 8, group=4)
    second["heldout_accuracy"] = 0.4
    (run_dir / "metrics.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"heldout_accuracy_before": 0.25, "heldout_accuracy_after": 0.5,
                                                      "steps": 2}))
    return run_dir


def test_peer_step_record_counts_as_our_trainer_does(tmp_path):
    record = json.loads((peer_records(tmp_path) / "metrics.jsonl").read_text().splitlines()[0])
    assert record["tokens_generated"] == 30 and record["tokens_trained"] == 30 + 80
    assert record["response_length_mean"] == 30 / 8 and record["reward_mean"] == 5 / 8
    assert record["zero_variance_group_fraction"] == 0.5  # the second group is all ones
    assert record["seconds_update"] == pytest.approx(0.5 - 0.25)  # the step after its experience
    assert record["tokens_per_second_rollout"] == pytest.approx(30 / 0.2)
    with pytest.raises(ValueError, match="full groups of 4"):
        trl_side.peer_step_record(1, 1, 1, {}, [1.0] * 6, [1] * 6, [1] * 6, group=4)


def test_peer_metrics_are_read_by_plot_metrics_and_time_to_accuracy(tmp_path):
    run = load_run(peer_records(tmp_path), "TRL peer")
    size = run_costs.ModelSize(parameters=1000, layers=2, hidden=16)
    costed = run_costs.with_costs(run, size, old_logprob_pass=False)
    assert [r["seconds_steps"] for r in costed.records] == pytest.approx([0.5, 0.9])
    assert [r["tokens_generated_total"] for r in costed.records] == [30, 94]
    # warm start at 0, then the final evaluation at the last step's time: the step-2 evaluation stands at the same x
    # (the last step), and a time has one accuracy, the final one (accuracy_curves counts each evaluation once)
    assert accuracy_curves.accuracy_points(costed, "seconds_steps") == [(0.0, 0.25), (0.9, 0.5)]
    phases = run_costs.phase_breakdown([costed])
    assert phases["seconds_step"] == pytest.approx(0.45) and phases["seconds_rollout"] == pytest.approx(0.2)
    assert plot_runs([costed], tmp_path / "figures", ("heldout_accuracy",), ("seconds_steps",))


def test_step_cost_ratios_are_ours_over_trls():
    ours = [{"seconds_step": s, "seconds_rollout": s / 2, "seconds_update": s / 4, "tokens_per_second_rollout": 1000.0,
             "tokens_generated": 400} for s in (0.3, 0.4, 0.9)]
    trl = [{"seconds_step": s, "seconds_rollout": s / 2, "seconds_update": s / 2, "tokens_per_second_rollout": 4000.0,
            "tokens_generated": 400} for s in (0.1, 0.2, 0.25, 5.0)]
    table, ratios = peer.step_cost_table(peer.step_costs(ours), peer.step_costs(trl))
    # medians: ours 0.4 s, TRL's (0.2 + 0.25) / 2 s
    assert ratios["our_grpo_step_vs_trl"] == pytest.approx(0.4 / 0.225)
    assert ratios["our_update_vs_trl_update"] == pytest.approx(0.1 / 0.1125)
    assert ratios["our_generation_tokens_per_s_vs_trl"] == pytest.approx(0.25)
    assert "| ours (GRPO) | 400 | 200 |" in table and "| TRL peer | 225 |" in table


def test_generators_are_timed_in_interleaved_rounds():
    calls = []

    def generator(name, tokens):
        def generate(repeat):
            calls.append((name, repeat))
            return tokens
        return generate

    rates = peer.interleaved_rates({"hf": generator("hf", 10), "engine": generator("engine", 20)}, repeats=2)
    assert calls == [("hf", 0), ("engine", 0), ("hf", 1), ("engine", 1), ("hf", 2), ("engine", 2)]
    assert rates["hf"]["tokens"] == 10 and rates["engine"]["tokens"] == 20
    assert rates["hf"]["tokens_per_s"] > 0 and rates["engine"]["tokens_per_s"] > 0


def test_peer_rewards_are_our_task_score_on_our_decoding_over_the_socket_pair():
    """A child process asks as the TRL worker does; this process answers with score_completions on a Task whose
    scorer wants the stop token in the response (the trainer decodes with special tokens kept)."""
    tokenizer = CharTokenizer.for_synthetic_task()

    def prompt(prompt_id, reference):
        return Prompt(prompt_id, tokenizer.encode("Q:1+1=?A:"), reference)

    train, heldout = [prompt(0, "12$"), prompt(1, "7$")], [prompt(-1, "30$")]
    task = Task(train, heldout, lambda responses, refs, fields: [float(r == ref) for r, ref in zip(responses, refs)],
                seed=0)
    pool = {p.prompt_id: p for p in train + heldout}
    completions = [tokenizer.encode("12$"), tokenizer.encode("30$"), tokenizer.encode("7")]
    parent_end, child_end = socket.socketpair()
    child = subprocess.Popen(
        [sys.executable, "-c", "import importlib.util, json, sys\n"  # the peer's file alone, as TRL's python runs it
         "from multiprocessing.connection import Connection\n"
         f"spec = importlib.util.spec_from_file_location('trl_side', {str(REPO / 'bench' / 'peer_grpo_trl.py')!r})\n"
         "trl_side = importlib.util.module_from_spec(spec); spec.loader.exec_module(trl_side)\n"
         f"print(json.dumps(trl_side.remote_scores(Connection({child_end.fileno()}), [0, -1, 1], {completions})))"],
        pass_fds=[child_end.fileno()], stdout=subprocess.PIPE, text=True)
    child_end.close()
    connection = Connection(parent_end.detach())
    served = []

    def score(prompt_ids, completion_ids):
        served.append(prompt_ids)
        return peer.score_completions(task, tokenizer, pool, prompt_ids, completion_ids)

    peer.serve_scores(connection, score, child, deadline=time.monotonic() + 60)  # returns when the child is done
    output, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and served == [[0, -1, 1]]
    # "12$" for 12$ and "30$" for the held-out 30$ score; "7" without its stop token does not
    assert json.loads(output) == [1.0, 1.0, 0.0]


def test_the_peer_env_script_and_the_bench_agree_on_the_default_environment(tmp_path, monkeypatch):
    for cache in (None, str(tmp_path / "xdg")):
        env = {"HOME": str(tmp_path / "home"), "PATH": os.environ["PATH"]}
        monkeypatch.setenv("HOME", env["HOME"])
        if cache is None:
            monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        else:
            env["XDG_CACHE_HOME"] = cache
            monkeypatch.setenv("XDG_CACHE_HOME", cache)
        printed = subprocess.run(["bash", str(REPO / "tools" / "setup_peer_env.sh"), "--print-env-dir"], env=env,
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        assert Path(printed) == peer.default_peer_env()


def test_the_peer_env_script_refuses_a_directory_inside_the_repository():
    result = subprocess.run(["bash", str(REPO / "tools" / "setup_peer_env.sh"), str(REPO / "peer-env")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "inside the repository" in result.stderr
    assert not (REPO / "peer-env").exists()


def test_generation_ratios_divide_the_engine_by_in_process_generate(tmp_path):
    args = grpo_args(tmp_path, "--rollout-engine-threads", "1")
    generation = {"hf_generate_2_threads": {"tokens_per_s": 4000.0, "tokens": 400},
                  "engine_as_trainer": {"tokens_per_s": 2000.0, "tokens": 410},
                  "engine_same_threads": {"tokens_per_s": 5000.0, "tokens": 405},
                  "trainer_engine_options": {"threads": 1, "workers": 2, "enable_deterministic_inference": True}}
    table, ratios = peer.generation_table(generation, args, threads=2)
    assert ratios == {"embedded_engine_vs_hf_generate_tokens_per_s": 0.5,
                      "embedded_engine_same_threads_vs_hf_generate_tokens_per_s": 1.25}
    assert table.count("embedded engine") == 2 and "2 worker(s) x 1 thread(s)" in table


def test_the_trainer_starts_one_engine_worker_with_a_thread_per_trainer_process_unless_async_or_told(tmp_path):
    from megatron_dppo.launch.run import embedded_engine_options

    common = {"enable_deterministic_inference": True, "disable_radix_cache": False}
    args = grpo_args(tmp_path)
    assert embedded_engine_options(args, 2) == {"threads": 2, "workers": 1, **common}
    args = grpo_args(tmp_path, "--async")  # the trainer computes while the engine generates: one thread a worker
    assert embedded_engine_options(args, 2) == {"threads": 1, "workers": 2, **common}
    args = grpo_args(tmp_path, "--rollout-engine-workers", "3", "--rollout-engine-threads", "2")
    assert embedded_engine_options(args, 2) == {"threads": 2, "workers": 3, **common}
