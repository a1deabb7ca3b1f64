# Two commands do all setup on a fresh machine:
#   make demo   the main job: a float16 DCGAN trained through the builder
#   make test   the test matrix (creates its own venvs with pinned packages)
PYTHON ?= python3
# TF 2.21.0: the primary runtime (fast float16 matmul on this CPU).
VENV ?= .venv
PY := $(VENV)/bin/python
# TF 2.15.1: the last TF with tf.estimator, and what Horovod 0.28.1 builds against.
VENV215 ?= .venv-tf215
PY215 := $(VENV215)/bin/python
# The Horovod wheel is built once per TF version and kept outside the clone,
# so later runs (and fresh clones on the same machine) skip the ~4 min build.
WHEELS ?= $(HOME)/.cache/npu_lossscale/wheels
PIP_FLAGS := -q --disable-pip-version-check
# The legs of the matrix. test-fast runs every tests/test_*.py on TF 2.21
# (control flow v2, resource variables). Each test file is also named below,
# in V1_TESTS, TF215_TESTS or both, or else in FAST_ONLY_TESTS: a new file
# chooses its legs, and tests/test_legs.py fails until it is named.
#
# V1_TESTS run again on TF 2.21 under v1 behaviour (ref variables,
# Switch/Merge conds, TF 1.15's default): whole files for the step (plan,
# gradients, overflow, gate, window, close, commit), the managers' state,
# the register, the skip record, what reads graphs (the audit, the graph
# walks) and TF 1.15's own routes (SyncReplicas, the graph rewrite, the
# shim's TF1 scripts), where ref variables and v1 control flow change the
# graph we make or read. For a capability built on a seam (its file named
# with ::tests), the tests that build its ops into a step and run it: the
# refusals, the argument checks and the variations of each run on v2 only.
V1_TESTS := tests/test_builder.py tests/test_plugins.py tests/test_gate.py tests/test_optimizer.py \
            tests/test_gradients.py tests/test_overflow.py tests/test_window.py \
            tests/test_close.py tests/test_update_ops.py tests/test_graph_state.py \
            tests/test_alternating.py tests/test_claims.py \
            tests/test_managers.py tests/test_manager_api.py tests/test_manager_state.py \
            tests/test_manager_npu_bridge.py tests/test_manager_checkpoints.py \
            tests/test_managers_extension.py tests/test_managers_hysteresis.py \
            tests/test_bfloat16.py tests/test_graph_rewrite.py \
            tests/test_npu_backend.py tests/test_backend_extension.py \
            tests/test_shim_adapter.py tests/test_device_loop.py tests/test_device_loop_step.py \
            tests/test_sequence.py tests/test_diagnostics.py \
            tests/test_misuse.py tests/test_underflow.py \
            tests/test_audit.py tests/test_sync_replicas.py tests/test_cluster_checks.py \
            tests/test_step_cost.py tests/test_seams_misuse.py tests/test_values_misuse.py \
            tests/test_monitoring.py::test_summaries_count_skips_by_reason_and_group \
            tests/test_monitoring.py::test_merged_summaries_fetched_alone_run_no_step \
            tests/test_monitoring.py::test_all_finite_inside_a_cond_branch_takes_the_outer_graphs_gradients \
            tests/test_monitoring.py::test_one_builder_with_per_group_ops_is_one_reader \
            tests/test_monitoring.py::test_the_hook_watches_alternating_per_group_runs \
            tests/test_monitoring.py::test_the_hook_counts_closed_windows_only \
            tests/test_managers_listening.py::test_raises_early_by_the_headroom_and_measures_every_n_updates \
            tests/test_managers_listening.py::test_per_group_ops_listen_too \
            tests/test_manager_misuse.py::test_custom_scale_outside_the_range_fails_the_run_and_moves_nothing \
            tests/test_manager_misuse.py::test_an_overridden_rule_that_breaks_the_range_fails_the_run \
            tests/test_first_scale.py::test_a_modelzoo_start_at_2_to_the_32_skips_no_step \
            tests/test_first_scale.py::test_with_per_group_ops_each_groups_first_run_measures_it \
            tests/test_first_scale.py::test_the_measured_flag_is_saved_and_a_restored_run_keeps_its_scale \
            tests/test_recipes.py::test_wgan_gp_overflow_in_the_penalty_is_skipped_atomically \
            tests/test_recipes.py::test_update_ops_recipe_takes_every_call_of_the_network \
            tests/test_port.py::test_ported_script_trains_and_skips_an_overflow_atomically \
            tests/test_skip_conditions.py::test_requested_steps_skip_and_hold_the_scale \
            tests/test_skip_conditions.py::test_a_spike_in_one_micro_batch_skips_the_window \
            tests/test_skip_conditions.py::test_a_requested_skip_in_a_per_group_op \
            tests/test_skip_conditions.py::test_the_spike_state_is_written_inside_a_functional_if \
            tests/test_towers.py::test_an_overflow_in_one_tower_skips_the_step_for_both \
            tests/test_towers.py::test_accumulation_averages_micro_batches_and_towers \
            tests/test_towers.py::test_no_collective_and_nothing_but_the_gate_inside_a_cond \
            tests/test_seams.py::test_a_gradient_transform_of_the_users \
            tests/test_seams.py::test_a_skip_condition_with_a_reason_of_its_own \
            tests/test_seams.py::test_a_step_observer_reports_and_runs_only_on_skipped_steps \
            tests/test_seams.py::test_a_reduction_engine_of_the_users \
            tests/test_transform_grads.py::test_the_fn_takes_and_returns_a_list_of_pairs_of_unscaled_gradients \
            tests/test_transform_grads.py::test_a_non_finite_output_at_the_windows_close_skips_the_window \
            tests/test_transform_grads.py::test_per_group_ops_apply_each_groups_fn \
            tests/test_xla_fusion.py::test_applied_values_equal_the_is_finite_steps
# TF215_TESTS run again on TF 2.15.1: what needs it (tf.estimator; Horovod,
# built against it: test_distributed.py and the audit's Horovod test), and
# what depends on TF's version rather than on our own logic: checkpoint
# formats, the shim's graph mechanics (the one status read and clear, their
# order in partition graphs after grappler, in loops, conds, functions and
# input pipelines; the register's lifetime: test_npu_backend.py's named
# tests, its policies and managers, our own logic, on TF 2.21 only),
# tf.layers and tf.function updates (test_update_ops.py's named tests),
# TF's op registry, TF's own classes as references, Keras 2's optimizers and
# layers (Keras 3 on TF 2.21), the public API on an older TF, and the
# scripts `python -m npu_lossscale.port` rewrites (issue 33: both legs).
TF215_TESTS := tests/test_estimator.py tests/test_distributed.py \
               tests/test_cluster_checks.py::test_horovods_wrapper_around_our_optimizer_trains_as_without_the_variable \
               tests/test_audit.py::test_horovod_allreduce_inside_cond \
               tests/test_cluster_checks.py::test_horovod_distributed_optimizer_under_horovodrun_env_builds \
               tests/test_checkpoint.py tests/test_manager_checkpoints.py \
               tests/test_optimizer.py tests/test_managers.py tests/test_shim.py \
               tests/test_graph_rewrite.py \
               tests/test_shim_adapter.py tests/test_shim_npu_init.py tests/test_device_loop.py \
               tests/test_device_loop_step.py::test_the_example_trains_on_a_loop_as_one_step_per_run \
               tests/test_device_loop_step.py::test_npu_estimator_checkpoints_land_where_asked_with_skips \
               tests/test_npu_backend.py::test_exactly_one_status_read_after_the_one_clear \
               tests/test_npu_backend.py::test_saturation_overflow_is_caught_by_npu_and_missed_by_is_finite \
               tests/test_npu_backend.py::test_saturation_overflow_skips_the_step_only_with_npu \
               tests/test_npu_backend.py::test_npu_backend_skip_is_atomic_in_inf_nan_mode \
               tests/test_npu_backend.py::test_the_clear_precedes_loops_conds_and_fed_defaults \
               tests/test_npu_backend.py::test_the_register_record_dies_with_its_graph \
               tests/test_npu_backend.py::test_a_float_status_step_inside_a_function_or_loop_body_is_refused \
               tests/test_npu_backend.py::test_grappler_cannot_move_a_cast_of_a_reshaped_input_before_the_clear \
               tests/test_npu_backend.py::test_a_placeholder_with_default_inside_a_v1_loop_body_runs \
               tests/test_npu_backend.py::test_a_data_pipelines_get_next_takes_no_edge_from_the_clear \
               tests/test_gate.py tests/test_graph_walk.py \
               tests/test_docs_claims.py tests/test_public_api.py \
               tests/test_misuse.py tests/test_graph_state.py \
               tests/test_update_ops.py::test_tf_layers_batch_norm_update_ops_are_accepted_and_gated \
               tests/test_update_ops.py::test_a_tf_function_that_updates_is_gated_whole \
               tests/test_manager_misuse.py::test_fixed_manager_rejects \
               tests/test_manager_misuse.py::test_exponential_manager_rejects \
               tests/test_manager_misuse.py::test_dynamic_manager_rejects \
               tests/test_port.py
# FAST_ONLY_TESTS run on TF 2.21 alone: checks without a TF graph (the
# plan, the static TF 1.15 API and Python 3.7 checks, this list's check, the
# docstring ratio, the port's rules on source snippets),
# is_finite's numbers, the peers' own test suites run on our step (the
# numbers it computes, against TF's, Keras's and contrib's classes; the
# step's graph under v1 is the lists' above), end-to-end runs of our own scripts whose TF 2.15 side
# the lists above cover (the GAN examples: test_distributed.py runs the DCGAN
# under horovodrun; the shim's two ranks: its HCCL runs; the porting example,
# the README's quick start, the docs' code blocks, docs/port.md's command
# (test_port.py runs the port's scripts on TF 2.15), the soak), and the
# benchmark smoke run (`make bench` runs on TF 2.21 only; on TF 2.15's slow
# float16 it took 100 s), and the warm fork server the tests start Python
# processes through (tests/warm_python.py, against a real interpreter).
FAST_ONLY_TESTS := tests/test_plan.py tests/test_tf115_api.py tests/test_py37_syntax.py \
                   tests/test_messages.py tests/test_peer_suites.py \
                   tests/test_legs.py tests/test_backends.py tests/test_examples.py \
                   tests/test_shim_distributed.py tests/test_porting.py \
                   tests/test_readme.py tests/test_docs.py tests/test_soak.py \
                   tests/test_benchmarks_quick.py tests/test_port_docs.py \
                   tests/test_port_rules.py tests/test_port_misuse.py tests/test_style.py \
                   tests/test_warm_python.py tests/test_engines_misuse.py
# Each leg runs on JOBS pytest-xdist workers (the machines have 2 cores);
# loadfile keeps each file on one worker, in order, so that module fixtures
# (the example runs, the benchmark and checkpoint runs) run once.
# Measured on 2026-12-02 on the 2-core machine: make test 7 min 18 s warm
# on a fresh clone (test-fast 4 min 4 s, test-v1 1 min 50 s, test-tf215
# 1 min 24 s, pytest's own times; 8 min 8 s earlier that day), with the
# tests' Python processes forked warm (tests/warm_python.py). The legs
# run one after another: all three at once (make -j3, 6 workers on 2 cores)
# took longer. docs/benchmarks.md has the earlier figures and why.
JOBS ?= 2
PYTEST_ARGS ?=
# Python caches compiled modules (tests/__pycache__, pytest's rewritten test
# files) even where the environment asks it not to: each leg's two workers
# would otherwise compile the suite again.
unexport PYTHONDONTWRITEBYTECODE
pytest = $(1) -m pytest -q -p no:cacheprovider -n $(JOBS) --dist loadfile \
         --no-loadscope-reorder $(PYTEST_ARGS)

.PHONY: venv venv215 demo test test-fast test-v1 test-tf215 bench bench-quick soak clean help

$(VENV)/.installed: requirements/tf221.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -r requirements/tf221.txt
	$(PY) -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation -e .
	touch $@

$(VENV215)/.installed: requirements/tf215.txt setup.py tools/build_horovod.sh
	$(PYTHON) -m venv $(VENV215)
	$(PY215) -m pip install $(PIP_FLAGS) -r requirements/tf215.txt
	bash tools/build_horovod.sh $(VENV215) $(WHEELS)
	$(PY215) -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed
venv215: $(VENV215)/.installed

demo: venv
	$(PY) examples/gan/dcgan.py --precision fp16 --out out/demo

# The matrix: everything on TF 2.21 (v2 control flow), V1_TESTS again under
# v1 behaviour, TF215_TESTS again on TF 2.15.1 (see the lists above).
test: test-fast test-v1 test-tf215

test-fast: venv
	$(call pytest,$(PY)) tests

test-v1: venv
	NPU_LOSSSCALE_GRAPH_MODE=v1 $(call pytest,$(PY)) $(V1_TESTS)

test-tf215: venv215
	$(call pytest,$(PY215)) $(TF215_TESTS)

bench: venv
	$(PY) benchmarks/run.py

bench-quick: venv
	$(PY) benchmarks/run.py --quick --out out/bench-quick

soak: venv
	$(PY) tools/soak.py --steps 100000

clean:
	rm -rf $(VENV) $(VENV215) out

help:
	@echo "make demo         train the float16 DCGAN through the builder (examples/gan/dcgan.py), write out/demo/"
	@echo "make test         the matrix: test-fast, then test-v1, then test-tf215 (builds both venvs)"
	@echo "make test-fast    the whole suite on TF 2.21 (.venv)"
	@echo "make test-v1      V1_TESTS on TF 2.21 under v1 behaviour (ref variables, Switch/Merge)"
	@echo "make test-tf215   TF215_TESTS on TF 2.15.1 (.venv-tf215): Estimator, Horovod, TF-version-sensitive tests"
	@echo "make venv         build .venv: tensorflow-cpu 2.21.0 (requirements/tf221.txt) and the library"
	@echo "make venv215      build .venv-tf215: tensorflow-cpu 2.15.1, Horovod 0.28.1 with Gloo, the library"
	@echo "make bench        the full benchmarks (benchmarks/run.py), results in benchmarks/"
	@echo "make bench-quick  a quick benchmark smoke run into out/bench-quick"
	@echo "make soak         a 100,000-step soak run with injected overflows (tools/soak.py)"
	@echo "make clean        remove .venv, .venv-tf215 and out/"
	@echo "make help         this list"
