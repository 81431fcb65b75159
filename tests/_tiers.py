"""What the README's test command runs, and what it leaves to ``--extended``.

CI runs the README's test command on 2 cores within 25 minutes, and the whole suite takes about twice that.
So the suite has two tiers.  The default tier runs every unit test, every parity test against torch's FSDP1,
FSDP2 and DDP, the course's tests, a slice of each long family below, and notebooks 01 and 06 under nbval.
``python -m pytest --nbval-lax --extended`` runs everything: run it before a change to the core, a notebook or
a planted fault lands (CONTRIBUTING.md), and after a torch upgrade.

The extended tier, each with the slice the default tier keeps:

* planted faults (``tests/planted_faults/catalog.py``): each re-runs its named test in a process of its own, a
  fault planted; the default tier plants ``CI_FAULTS``: the flat parameter, prefetch, the core's divide, a pitfall
  check and the grader (mixed precision, fully_shard and the ring are --extended's);
* the fuzzer's CI programs: seeds 0-5 (FSDP1, and the campaign's findings) and 0-3 (FSDP2) by default, 0-39
  and 0-23 extended;
* torch's FSDP1 suite port: its ``fast`` cases by default (the FSDP2 port keeps its own CI slice);
* notebooks 02, 03, 04 and 05 under nbval (their checked cells compare with torch, as tests/ does; 03 trains a
  model for minutes);
* runs through torchrun or a browser, and the long end-to-end runs named in ``_EXTENDED`` below.
"""

from __future__ import annotations

import re

CI_FAULTS = {"padded_size_rounds_down", "prefetch_direction", "divide_factor_post_forgotten",
             "wrap_fingerprint_without_its_negative", "grader_counts_a_skipped_test"}
CI_FUZZ_SEEDS = {"fsdp1": 6, "fsdp2": 4}  # seeds 0..n-1 of each
CI_NOTEBOOKS = ("01_", "06_")

_EXTENDED = (  # node-id prefixes: long runs whose subject a default-tier test also holds
    "tests/test_browser.py::test_a_whole_notebook_runs_in_the_browser_without_an_error",  # (and below: the other
    # notebooks' first view; notebook 01's stays)
    "tests/test_teardown.py::test_notebook_01_train_ddp_under_torchrun_exits_cleanly_3_times",
    "tests/test_launch_torchrun.py::",
    "tests/test_fault_tolerance.py::test_torchrun_restarts_from_the_last_checkpoint_after_a_sigkill",
    "tests/test_train_job.py::test_torchrun_logs_bitwise_the_same_as_world_size_2",
    "tests/test_train_job.py::test_a_trained_model_beats_the_untrained_one_on_text_it_never_saw",
    "tests/test_hf_models.py::test_bert_is_wrapped_by_its_layers_as_torch_wraps_it",
    "tests/test_exercise_grading.py::test_an_honest_copy_in_a_class_earns_its_points",  # the reference's run holds it
    "tests/test_memory_vs_torch.py::test_a_dropped_model_is_freed",
    "tests/test_compare.py::test_bench_fsdp_cli_runs_small_and_writes_ratios",
    "tests/test_torch_suite.py::test_fast_slice_through_the_command",
    "tests/test_torch_suite.py::test_runner_catches_planted_faults",
    "tests/test_plan_measured.py::test_peak_within_ten_percent[4]",  # 2 ranks stay in the default tier
    "tests/test_plan_measured.py::test_model_state_equals_the_census[4]",
    "tests/test_plan_measured.py::test_bytes_sent_equal_count_bytes[4]",
    "tests/test_memory_vs_torch.py::test_live_bytes_at_most_torch_fsdp1_at_3_ranks_and_hybrid_at_4",
    "tests/test_memory_census.py::test_tracker_equals_census_for_every_trainer",
    "tests/test_browser.py::test_the_ring_slider_redraws_in_the_browser",
    "tests/test_browser.py::test_an_explorer_redraws_what_the_library_computes_for_the_new_setting",
    "tests/test_explorers_train_live.py::test_the_explorer_reads_the_losses_the_job_logged",  # a real job,
    "tests/test_explorers_train_live.py::test_stop_kills_the_job_and_resume_continues_from_the_checkpoint",  # twice
    "tests/test_explorers_train_live.py::test_the_panels_start_button_runs_the_job_and_its_output_follows_it",
    "tests/test_memory_vs_torch.py::test_at_rest_ours_holds_nothing_that_gloos_worker_thread_was_slow_to_drop",
    "tests/test_memory_census.py::test_on_peak_runs_a_witness_at_the_peak",
    "tests/test_memory.py::test_two_ranks_ddp_vs_fsdp1_memory",  # test_memory_vs_torch holds ours against torch
    "tests/test_route.py::test_the_step_route_prints_its_own_count",  # the tool's count itself: a planted hop
    *(f"tests/test_browser.py::test_notebook_opens_with_its_chinese_heading_and_plots[{n}" for n in  # 01 stays
      ("02_", "03_", "04_", "05_", "06_")),
    # siblings stay: the bitwise compare of fully_shard, the default compare CLI, the 0.72 budget, the gpt model
    "tests/test_compare_fsdp2.py::test_bench_fsdp_ours_fsdp2_row_is_read_against_torch_fsdp2",
    "tests/test_compare.py::test_compare_cli_prints_table_verdict_and_saves_png",
    "tests/test_devices.py::test_gpu_suite_is_collected_here_and_says_why_it_skips",
    "tests/exercises/projects/test_ac_budget.py::test_project_ac_budget_fits_with_the_fewest_blocks[0.85]",
    "tests/test_memory_vs_torch.py::test_live_bytes_at_most_torch_fsdp1_at_2_ranks[mlp]",
    # 40 s of spawn; test_plan_fsdp2.py holds the same layout against minifsdp.fsdp2's own in the default tier
    "tests/test_plan_fsdp2_measured.py::",
)


def extended(nodeid: str) -> bool:
    """Whether the README's test command leaves this test to ``--extended``."""
    if nodeid.startswith("notebooks/"):
        return not nodeid.startswith(tuple("notebooks/" + n for n in CI_NOTEBOOKS))
    if nodeid.startswith("tests/test_planted_faults.py::test_named_test_fails_under_the_planted_fault["):
        return nodeid.split("[", 1)[1].rstrip("]") not in CI_FAULTS
    fuzz = re.match(r"tests/test_fuzz\.py::test_program_equals_torch\[(fsdp[12])-(\d+)\]$", nodeid)
    if fuzz:
        return CI_FUZZ_SEEDS[fuzz.group(1)] <= int(fuzz.group(2)) < 100000  # (campaign findings: default)
    return nodeid.startswith(_EXTENDED)


def extended_item(item) -> bool:
    """:func:`extended`, and the FSDP1 port's cases without its ``fast`` mark."""
    if item.nodeid.startswith("tests/torch_suite/test_") and item.get_closest_marker("fast") is None:
        return True
    return extended(item.nodeid)
