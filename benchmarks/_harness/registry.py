"""What each benchmark report claims: the rows of the figures table in ``docs/benchmarks.md``.

One entry per report name (``runs/<name>/<name>.json``; a benchmark whose options change what it measures writes
under a variant's name, e.g. ``swarm_hop_1000mbit``), in the order of the table: the command that measures it, the
claim in words, its target, the JSON keys the table shows as the latest figure (dotted paths into the JSON, the
headline first) and whether it needs root (network namespaces, cgroups). Where a report exists, its own command
line, date, commit and load are shown (``report.py``). ``scripts/benchmark_table.py`` reads this.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    command: str  # what measures it, from the repository root (a report's own command line wins)
    claim: str
    target: str
    figures: tuple[str, ...]  # the first one is the headline (bold)
    root: bool = False


NONE = "none stated"

# the headline figures of albert_fidelity.py (one configuration)
# the several-trainers matrix's headline figures (its quick and full runs)
_TRAINERS_HEADLINE = (
    "max_relative_gap",
    "trainer_params_identical",
    "stage_steps_equal",
    "async_max_relative_gap",
    "uncompressed_max_relative_gap",
    "meets_target",
)
_FIDELITY_KEYS = ("relative_gap", "meets_target", "loss_swarm", "loss_single", "steps", "stage_steps")
# the figures of albert_fidelity.py --matrix (compression beyond 8 bit), shaped link or not
_FIDELITY_MATRIX_KEYS = (
    "target_met",
    "relative_gap",
    "bytes_vs_fp32",
    "bytes_per_sample",
    "time_to_target_s",
    "time_to_target_s_single",
    "best_boundary",
    "steps",
    "target_step",
)

BENCHMARKS: dict[str, Claim] = {
    "albert_fidelity": Claim(
        "python benchmarks/albert_fidelity.py --quick",
        "ALBERT fidelity: 1 trainer + 2 stage servers with 8-bit boundaries vs plain Lightning, same seed, data, "
        "global batch and optimizer steps",
        "`relative_gap` <= 0.03",
        (*_FIDELITY_KEYS, "bytes_vs_fp32", "bytes_per_sample", "wire_bytes_swarm", "fp32_boundary_bytes"),
    ),
    "albert_fidelity_2peers": Claim(
        "python benchmarks/albert_fidelity.py --quick --peers-per-stage 2",
        "ALBERT fidelity with 2 server peers per stage (the main job's layout: each stage's peers sum their "
        "gradients at every step), 8-bit boundaries, vs plain Lightning, same seed, data, global batch and "
        "optimizer steps",
        "`relative_gap` <= 0.03",
        (*_FIDELITY_KEYS, "peers_per_stage"),
    ),
    "albert_fidelity_matrix_100mbit": Claim(
        "python benchmarks/albert_fidelity.py --quick --matrix --link-mbit 100",
        "ALBERT fidelity beyond 8 bit: 1 trainer + 2 stage servers, uncompressed / 8-bit / maxout and bottleneck "
        "boundaries (factor 4) on top of 8-bit, vs one plain-model process, same seed, data, global batch and steps; "
        "every peer on one shared loopback shaped to 100 Mbit/s; `time_to_target_s`: training time until the "
        "10-step mean loss reaches the single process's loss after 2/3 of the steps. With a boundary every hop "
        "narrows, the trainer's too (`boundary_ends`)",
        "a configuration with `bytes_vs_fp32` <= 0.1 at `relative_gap` <= 0.03",
        (*_FIDELITY_MATRIX_KEYS, "link_measured_mbit"),
        root=True,
    ),
    "albert_fidelity_matrix": Claim(
        "python benchmarks/albert_fidelity.py --quick --matrix",
        "ALBERT fidelity beyond 8 bit: uncompressed / 8-bit / maxout and bottleneck boundaries (factor 4) on top "
        "of 8-bit vs one plain-model process, on loopback (no shaping)",
        "a configuration with `bytes_vs_fp32` <= 0.1 at `relative_gap` <= 0.03",
        _FIDELITY_MATRIX_KEYS,
    ),
    "fidelity_matrix": Claim(
        "python benchmarks/fidelity_matrix.py --quick",
        "fidelity matrix: GPT, ViT, encoder, CNN, ALBERT; swarm (1 trainer, 2 stages, 8-bit) vs one process, "
        "same seed, data, batch, steps; `seed_gaps`: two single-process seeds (the noise floor)",
        "`max_relative_gap` <= 0.02, stage steps equal",
        (
            "max_relative_gap",
            "gaps",
            "seed_gaps",
            "stage_steps_equal",
            "meets_target",
            "steps",
            "global_batch",
        ),
    ),
    "fidelity_matrix_trainers": Claim(
        "python benchmarks/fidelity_matrix.py --quick --trainers 2,4",
        "fidelity matrix with several trainers: each family in a swarm of K trainers (2 stages, 8-bit; synchronous "
        "steps, the default) vs Lightning's DDP on K CPU devices, same seed, data shards, global batch and steps; "
        '`async_max_relative_gap`: the asynchronous mode (`stage_steps="async"`) against the same DDP; '
        "`uncompressed_max_relative_gap`: the synchronous mode with uncompressed boundaries (the step's own cost, "
        "the 8-bit codec's rounding aside); `by_trainers.K.seed_gaps`: DDP with another seed (the noise floor)",
        "`max_relative_gap` <= 0.02, trainers' own parameters identical, stage steps equal (one per global step)",
        (
            *_TRAINERS_HEADLINE,
            "trainers",
            "by_trainers.2.gaps",
            "by_trainers.2.seed_gaps",
            "by_trainers.2.async_gaps",
            "by_trainers.2.uncompressed_gaps",
            "by_trainers.4.gaps",
            "steps",
            "global_batch",
        ),
    ),
    "fidelity_matrix_trainers_full": Claim(
        "python benchmarks/fidelity_matrix.py --trainers 2,4",
        "fidelity matrix with several trainers, the full run (200 steps of global batch 64; `families`: those run): "
        "each family in a swarm of K trainers (2 stages, 8-bit; synchronous steps) vs Lightning's DDP on K CPU "
        "devices, same seed, data shards, global batch and steps; `uncompressed_max_relative_gap`: the synchronous "
        "mode with uncompressed boundaries; `by_trainers.K.seed_gaps`: DDP with another seed (the noise floor)",
        "`max_relative_gap` <= 0.02, trainers' own parameters identical, stage steps equal (one per global step)",
        (
            *_TRAINERS_HEADLINE,
            "families",
            "trainers",
            *(
                f"by_trainers.{k}.{gaps}"
                for k in (2, 4)
                for gaps in ("gaps", "seed_gaps", "uncompressed_gaps")
            ),
            "steps",
            "global_batch",
        ),
    ),
    "swarm_trainers": Claim(
        "python benchmarks/swarm_trainers.py --quick",
        "several trainers feeding one swarm (2 stages x 2 peers on loopback, the fidelity matrix's ALBERT, batch 16 "
        "per trainer): "
        'samples/s of synchronous steps (DDP\'s step, the default) against asynchronous ones (`stage_steps="async"`) '
        "at 1, 2 and 4 trainers, interleaved",
        "`sync_vs_async` >= 0.9 at 2 and at 4 trainers",
        ("sync_vs_async_2", "sync_vs_async_4", "meets_target", "samples_per_s", "steps"),
    ),
    "square_cube": Claim(
        "python benchmarks/square_cube.py --quick",
        "square-cube law: one Transformer block's forward+backward (1 thread) vs sending its boundary activations "
        "and gradients at 100 Mbit/s and 1 Gbit/s",
        "ratio grows with size",
        (
            "ratio_grows_with_size",
            "ratio_growth_256_to_4096_8bit_100mbit",
            "tokens_per_microbatch",
            "measured_size",
            "measured_vs_computed",
            "netns_error",
        ),
        root=True,
    ),
    "swarm_internet": Claim(
        "python benchmarks/swarm_internet.py --quick",
        "volunteers on an internet-like test bed: 9 hosts in network namespaces on 100 Mbit/s links with 50 ms of "
        "round trip between two hosts (`rtt_ms`; each host's outgoing packets held half of it), 2 stage servers "
        "and 1 trainer behind NAT (iptables MASQUERADE), the rest public, default "
        "reachability ('auto'); a 2-stage MLP; then one public stage server SIGKILLed every kill period and a new "
        "one started half a period later",
        "all NAT'd servers serve; `retained` >= 0.75, `samples_lost` 0, `hangs` 0 (the memory target of a "
        "4-peer stage is the averaging row's)",
        (
            "nat_peers_serving",
            "nat_servers",
            "relay_share_of_calls",
            "throughput_relayed_vs_direct",
            "retained",
            "samples_lost",
            "hangs",
            "kills",
            "rtt_ms",
            "healthy_samples_per_s",
            "churn_samples_per_s",
            "serving_pss_growth_mb_per_hour",
        ),
        root=True,
    ),
    "swarm_internet_averaging": Claim(
        "python benchmarks/swarm_internet.py --averaging",
        "averaging at scale on the internet-like test bed: 2 stages x 4 stage servers, each in a network namespace "
        "of its own on a 100 Mbit/s link (one per stage behind NAT), a 2-stage MLP; synchronous steps "
        "(`stage_steps_mode`): one public trainer commands the stages' step after each of its steps, each step an "
        "all-reduce round of the stage's peers through their p2p daemons (same_host off); each server's memory "
        "(PSS, with its helper processes) sampled over a 30-minute run",
        "`rss_growth_mb_per_hour` <= 50 (`meets_target`) while every peer averages every step "
        "(`every_peer_every_step`: `rounds_per_step` >= 0.95, `mean_group_size` >= 3.9)",
        (
            "rss_growth_mb_per_hour",
            "rounds_per_step",
            "mean_group_size",
            "every_peer_every_step",
            "peers_per_stage",
            "stage_steps",
            "trainer_steps",
            "run_minutes",
            "meets_target",
            "stage_steps_mode",
        ),
        root=True,
    ),
    "swarm_averaging": Claim(
        "python benchmarks/swarm_averaging.py",
        "averaging at scale: 2 stages x 4 peers on 127.0.0.1 (the fidelity matrix's GPT, 2 trainers, synchronous "
        "steps), every stage's 4 peers sum each step's gradients in one hivemind all-reduce round (same_host off); "
        "each peer's memory (PSS, with its helper processes) sampled while it trains",
        "`rounds_per_step` 1.0 and the stages stepped once per global step; `rss_growth_mb_per_hour` <= 50",
        (
            "rounds_per_step",
            "rss_growth_mb_per_hour",
            "stage_steps_equal",
            "steps_per_s",
            "peers_per_stage",
            "steps",
            "meets_target",
        ),
    ),
    "swarm_faults": Claim(
        "python benchmarks/swarm_faults.py --quick --width 2048 --blocks 4",
        "swarm (2 stages x 2 peers, one trainer) vs torch GPipe (2 ranks) restarted from checkpoints every N steps "
        "(Young's N), same MLP, microbatches, optimizer and 2 cores, over loopback: one last-stage process SIGKILLed "
        "every kill period (swarm: a replacement started at once; GPipe: both ranks restarted), and, without kills, "
        "one last-stage process at half a core (swarm: plus a normal peer on that stage; GPipe also on the fast "
        "processes alone). Both sides count the samples of committed optimizer steps only",
        "`speedup_vs_gpipe_faults` >= 1.5, `speedup_vs_gpipe_hetero` >= 1.3",
        (
            "speedup_vs_gpipe_faults",
            "speedup_vs_gpipe_hetero",
            "speedup_vs_gpipe_hetero_no_checkpoints",
            "speedup_vs_gpipe_hetero_fast_only",
            "speedup_vs_gpipe_healthy",
            "throughput_faults_swarm",
            "throughput_faults_gpipe",
            "throughput_hetero_swarm",
            "throughput_hetero_gpipe",
            "throughput_hetero_gpipe_no_checkpoints",
            "throughput_hetero_gpipe_fast_only",
            "throughput_healthy_swarm",
            "throughput_healthy_gpipe",
            "retained",
            "retained_gpipe",
            "gpipe_checkpoint_every_steps",
            "gpipe_restart_s",
            "kills",
            "downtime_s",
            "width",
            "blocks",
        ),
        root=True,
    ),
    "fuzz_rpc": Claim(
        "python benchmarks/fuzz_rpc.py --quick",
        "a stage server under hostile requests (garbage, truncated, wrong dtype/sizes, huge sizes, 8-bit bombs, an "
        "endless stream, NaN/Inf, unknown stage, a 64-channel flood), then generated malformed requests",
        "0 crashes; RSS growth < 500 MB",
        (
            "server_crashes",
            "well_formed_after_ok",
            "max_rss_growth_mb",
            "generated_requests",
            "error_replies",
            "cut_streams",
            "accepted",
            "hostile_cases",
            "seconds",
        ),
    ),
    "quantizer_exhaustive": Claim(
        "python benchmarks/quantizer_exhaustive.py --quick",
        "fast 8-bit kernel vs bitsandbytes' CPU kernel on every float32 value in [-1, 1], same bytes; timings on "
        "1 MiB of fp32, one thread",
        "0 mismatches",
        (
            "mismatches",
            "values_checked",
            "seconds",
            "fast_quantize_ms",
            "bitsandbytes_quantize_ms",
            "quantize_speedup",
            "fast_dequantize_ms",
            "bitsandbytes_dequantize_ms",
        ),
    ),
    "quantizer_speed": Claim(
        "python benchmarks/quantizer_exhaustive.py --speed-only",
        "fast 8-bit kernel vs bitsandbytes' CPU kernel, 1 MiB of fp32, one thread (the timings alone)",
        NONE,
        (
            "quantize_speedup",
            "fast_quantize_ms",
            "bitsandbytes_quantize_ms",
            "fast_dequantize_ms",
            "bitsandbytes_dequantize_ms",
            "dequantize_speedup",
        ),
    ),
    "swarm_vs_alternatives": Claim(
        "python benchmarks/swarm_vs_alternatives.py --quick --rounds 3 --split-ablation",
        "SWARM (2 peers, 8-bit) vs torch GPipe (fp32/fp16) vs DDP, one 103M-parameter Transformer split over two "
        "namespaces on a shaped veth, 1 core each, same samples and global batch; one box: 2 peers vs one process",
        "`speedup_vs_gpipe` >= 1.0 at both links, `efficiency_single_box` >= 0.85, `speedup_vs_ddp` >= 3",
        (
            "per_link.100mbit.speedup_vs_gpipe",
            "per_link.100mbit.speedup_vs_gpipe_fp16",
            "per_link.100mbit.speedup_vs_ddp",
            "per_link.1000mbit.speedup_vs_gpipe",
            "per_link.1000mbit.speedup_vs_gpipe_fp16",
            "per_link.1000mbit.speedup_vs_ddp",
            "per_link.100mbit.speedup_from_split_backward",
            "per_link.1000mbit.speedup_from_split_backward",
            "per_link.100mbit.rounds.speedup_vs_gpipe_by_round",
            "per_link.1000mbit.rounds.speedup_vs_gpipe_by_round",
            "efficiency_single_box",
            "samples_per_s_swarm_local",
            "samples_per_s_single",
            "samples_per_s_single_1thread",
        ),
        root=True,
    ),
    "split_backward": Claim(
        "python benchmarks/split_backward.py",
        "split backwards: one stage of the GPipe benchmark (4 Transformer layers of 1024, 2 x 16 tokens, 1 thread), "
        "its input-gradient pass (B) and parameter-gradient pass (W) against its whole backward",
        "B well under the whole backward, B + W near it, the same gradients",
        (
            "b_fraction",
            "overhead",
            "b_ms",
            "w_ms",
            "whole_backward_ms",
            "forward_ms",
            "max_abs_grad_difference",
        ),
    ),
    "kept_activations": Claim(
        "python benchmarks/kept_activations.py --quick",
        "kept activations: one trainer calling a remote stage (4 MLP blocks, hidden 512), Adam every 4 calls",
        NONE,
        ("speedup", "samples_per_s_recompute", "samples_per_s_kept", "kept_hits_per_backward"),
    ),
    "batched_stage": Claim(
        "python benchmarks/batched_stage.py --quick",
        "batched stage servers: 4 trainers calling one stage peer (2 MLP blocks, hidden 512), batching off, "
        "serving threads without merging, merging on",
        NONE,
        (
            "speedup",
            "samples_per_s_unbatched",
            "samples_per_s_threads_no_merging",
            "samples_per_s_batched",
            "speedup_of_merging",
            "computations_per_request_batched",
        ),
    ),
    "swarm_hop_1000mbit": Claim(
        "python benchmarks/swarm_hop.py --quick --link-mbit 1000",
        "one stage hop (1 MiB fp32, 8-bit) vs an echo over the same long-lived stream, trainer and server in two "
        "network namespaces on a 1 Gbit/s link",
        "`ratio_vs_stream_echo` <= 0.45",
        (
            "ratio_vs_stream_echo",
            "hop_ms",
            "raw_stream_echo_ms",
            "floor_ms",
            "hop_vs_floor",
            "hop_ms_fp16",
            "hop_ms_none",
            "order",
        ),
        root=True,
    ),
    "swarm_hop_100mbit": Claim(
        "python benchmarks/swarm_hop.py --quick --link-mbit 100",
        "one stage hop (1 MiB fp32, 8-bit) vs an echo over the same long-lived stream, trainer and server in two "
        "network namespaces on a 100 Mbit/s link",
        "`ratio_vs_stream_echo` <= 0.3",
        ("ratio_vs_stream_echo", "hop_ms", "raw_stream_echo_ms", "floor_ms", "hop_vs_floor", "order"),
        root=True,
    ),
    "swarm_hop": Claim(
        "python benchmarks/swarm_hop.py --quick",
        "one stage hop (1 MiB fp32, 8-bit) vs an echo over the same long-lived stream, on loopback (no shaping); "
        "the same hop through the same-host socket instead of the p2p daemons",
        NONE,
        (
            "ratio_vs_stream_echo",
            "hop_ms",
            "raw_stream_echo_ms",
            "hop_ms_fp16",
            "hop_ms_none",
            "raw_echo_ms",
            "hop_ms_same_host",
            "ratio_same_host_vs_p2p",
        ),
    ),
    "swarm_rebalance": Claim(
        "python benchmarks/swarm_rebalance.py --quick",
        "adaptive rebalancing: 4 peers of speeds 2,1,1 on stage 0 and 2 on stage 1 (sleep-simulated), rebalancing on",
        "`optimal_over_initial` >= 1.3, `speedup_from_rebalancing` >= 1.3, `fraction_of_optimal` 0.9-1.1",
        (
            "meets_target",
            "speedup_from_rebalancing",
            "fraction_of_optimal",
            "optimal_over_initial",
            "throughput_initial",
            "throughput_rebalanced",
            "throughput_optimal",
            "throughput_before_first_move",
            "first_move_s",
            "settled_s",
            "final_placement",
            "failed_calls",
        ),
    ),
    "swarm_memory": Claim(
        "python benchmarks/swarm_memory.py --quick",
        "memory of a peer of the main job (ALBERT `swarm.yaml`, 4 peers), peak PSS of its processes",
        NONE,
        ("mean_peer_total_mb", "mean_peer_main_mb", "steps", "tracebacks_in_output"),
    ),
    "swarm_memory_scale": Claim(
        "python benchmarks/swarm_memory.py --quick --scale",
        "models larger than one peer: worst peer's peak PSS (helpers included) / one plain process, MLP pipeline, "
        "4 stages x 1 peer, Adam, 3 steps",
        "`ratio` <= 0.35 (`init_module`, `configure_model`), <= 0.5 (`init`)",
        (
            "init_module.ratio",
            "params",
            "peak_mb_single",
            "floor_mb",
            "init.ratio",
            "configure_model.ratio",
            "capped_swarm_completed",
            "capped_single_completed",
        ),
    ),
    "sparse_vs_dense": Claim(
        "python benchmarks/sparse_vs_dense.py --quick",
        "SparseLSHLinear vs dense `nn.Linear` + Adam, batch 256, synthetic Amazon-670K-shaped data: step time at "
        "670,091 labels, time to accuracy, `read_xc_file`",
        "`time_to_p1_ratio` >= 10 at 670,091 labels; at 20,000 (`quality_labels`): >= 5, with "
        "`p_at_1_sparse_best` >= `p_at_1_dense_best` - 0.01 and `dense_converged`",
        (
            "time_to_p1_ratio",
            "speedup",
            "step_ms_sparse",
            "step_ms_dense",
            "p_at_1_sparse_best",
            "p_at_1_dense_best",
            "quality_labels",
            "dense_converged",
            "reader_lines_per_s",
            "reader_lines_per_s_line_by_line",
        ),
    ),
    "dslide_vs_ddp": Claim(
        "python benchmarks/dslide_vs_ddp.py",
        "D-SLIDE vs one process and vs DDP, Amazon-670K-shaped network (103M parameters), batch 256, shaped veths",
        "`parallel_efficiency` >= 0.85 (median of 3 interleaved rounds), `parallel_efficiency_best` >= 0.7, "
        "`model_rss_ratio_4_ranks` <= 0.3",
        (
            "parallel_efficiency",
            "parallel_efficiency_rounds",
            "parallel_efficiency_best",
            "parallel_efficiency_loopback",
            "model_rss_ratio_4_ranks",
            "comm_reduction",
            "comm_reduction_ranks",
            "step_ms_single_sparse",
            "step_ms_dslide_2",
            "step_ms_dslide_4",
            "step_ms_ddp_sparse",
            "step_ms_ddp_dense",
        ),
        root=True,
    ),
    "collective_latency": Claim(
        "python benchmarks/collective_latency.py",
        "one D-SLIDE collective (all-reduce of 128 KB between 2 ranks pinned to a core each, after 5 ms of "
        'compute): the socket mesh (`collectives="socket"`, the default) against gloo waited for by spinning '
        '(`collectives="gloo"`, the strategy\'s own gloo path); gloo blocking for reference',
        NONE,
        ("mesh_speedup_vs_gloo_spin", "ms", "mesh_speedup_vs_gloo_block", "ms_rounds"),
    ),
    "dslide_faults": Claim(
        "python benchmarks/dslide_faults.py",
        "a D-SLIDE job of 4 ranks (devices=4, one thread each, loopback) with a rank SIGKILLed every N steps (rank 2, "
        "rank 0, rank 2: `killed_ranks`): automatic sharded checkpoints every K steps, the process started supervises "
        "the ranks and restarts them from the last one; against the same "
        "job uninterrupted and one plain process (`--quick`: the small network)",
        "`completed` true; at most K steps redone per kill; P@1 within noise of the uninterrupted run",
        (
            "completed",
            "steps_redone",
            "steps_redone_per_kill",
            "checkpoint_every_n_steps",
            "time_lost_per_kill_s",
            "down_s_per_kill",
            "p_at_1_killed",
            "p_at_1_uninterrupted",
            "p_at_1_single",
            "max_abs_param_diff_vs_single",
            "kills",
            "killed_ranks",
            "width",
        ),
    ),
    "dslide_scale_8ranks": Claim(
        "python benchmarks/dslide_scale.py --ranks 8",
        "D-SLIDE at the paper's scale on 8 ranks, each in its own network namespace on a veth shaped to 1 Gbit/s "
        "(no added latency): 135,909 -> `hidden` -> 670,091, 1 thread per rank, batch 256, LazyAdam, against one "
        "process (2 threads) on the same steps (`--quick`: hidden 256)",
        "`model_rss_ratio_8_ranks` <= 0.16, `exact` true",
        (
            "model_rss_ratio_8_ranks",
            "exact",
            "max_rel_loss_diff",
            "bytes_per_step",
            "bytes_per_step_ddp_dense",
            "bytes_vs_ddp",
            "tx_bytes_per_step_per_rank",
            "step_ms",
            "step_ms_single",
            "model_rss_mb_per_rank",
            "model_rss_mb_single",
            "hidden",
            "link_rate_mbit",
        ),
        root=True,
    ),
    "dslide_scale": Claim(
        "python benchmarks/dslide_scale.py --quick",
        "D-SLIDE at the paper's scale: 135,909 -> `hidden` -> 670,091, 4 ranks x 1 thread, batch 256, LazyAdam "
        "(`--quick`: hidden 256)",
        NONE,
        (
            "params",
            "hidden",
            "step_ms",
            "rebuild_ms",
            "rebuild_ms_incremental",
            "p_at_1_first",
            "p_at_1_last",
            "checkpoint_mb",
            "checkpoint_rows_match",
            "peak_rss_mb_per_rank",
            "peak_rss_mb_single",
            "peak_rss_ratio",
        ),
    ),
}
