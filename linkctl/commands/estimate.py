"""`linkctl estimate` and `linkctl calibrate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from linkctl.commands.common import (
    CalibrationOpt,
    HostOpt,
    JsonOpt,
    LlamaBinDirOpt,
    ProfileOpt,
    emit_json,
    load,
)

ModelOpt = Annotated[
    Path,
    typer.Option(
        "--model", "-m", help="Path to a .gguf model (only its header is read).", show_default=False
    ),
]


def register(app: typer.Typer) -> None:
    @app.command("estimate")
    def estimate_cmd(
        model: ModelOpt,
        profile: ProfileOpt = None,
        probe: Annotated[
            Path | None,
            typer.Option(
                "--probe",
                help="Probe report JSON: `linkctl probe --peer NAME --json` output (a list of "
                "one) or a saved report (default: the saved `linkctl probe` report).",
                show_default=False,
            ),
        ] = None,
        split: Annotated[
            str | None,
            typer.Option(
                "--split",
                help="The layer split to predict, as `linkctl serve --split` takes it: "
                "llama (llama.cpp's own, by free memory; the default), recommended (the "
                "estimate's fastest, what serve runs by default) or weights W,W,... per "
                "split device in llama.cpp order (rpc hosts, then the head's GPU), e.g. 3,1.",
                show_default=False,
            ),
        ] = None,
        ctx: Annotated[
            int | None,
            typer.Option(
                "--ctx",
                help="Context length to allocate: sizes the KV cache for the memory fit "
                "(default: the profile's serve.ctx).",
                show_default=False,
            ),
        ] = None,
        prompt: Annotated[
            int, typer.Option("--prompt", help="Prompt tokens for the prefill estimate.")
        ] = 512,
        depth: Annotated[
            int | None,
            typer.Option(
                "--depth",
                help="Context position decode is predicted at: KV-cache reads per token "
                "(default: --prompt, the first token after the prompt). Decode at 0 and at "
                "the full --ctx is shown too.",
                show_default=False,
            ),
        ] = None,
        rtt_us: Annotated[
            float | None,
            typer.Option(
                "--rtt-us",
                help="What-if: link round trip in µs (overrides the probe report).",
                show_default=False,
            ),
        ] = None,
        throughput_gbps: Annotated[
            float | None,
            typer.Option(
                "--throughput-gbps",
                help="What-if: link throughput in Gbit/s (overrides the probe report).",
                show_default=False,
            ),
        ] = None,
        query_rpc: Annotated[
            bool,
            typer.Option(
                "--query-rpc",
                help="Ask each rpc-server for its free memory (GET_DEVICE_MEMORY) "
                "instead of using the profile's memory_gb.",
            ),
        ] = False,
        calibration: CalibrationOpt = None,
        output: Annotated[
            int,
            typer.Option(
                "--output",
                help="Output tokens for the time-to-first-token and end-to-end figures "
                "(local, layer split, disaggregated).",
            ),
        ] = 256,
        json_out: JsonOpt = False,
    ) -> None:
        """Predict decode and prefill tokens/s locally and split over the link.

        It needs the link's round trip and throughput: from the saved probe report
        (`sudo linkctl probe` writes it; so does the link unit `linkctl up` installs),
        or from --rtt-us and --throughput-gbps together (a what-if, no probe needed; they
        also override the report's figures). With neither it refuses (exit 2).

        Also predicts one request's time to first token and end-to-end time for --prompt
        and --output tokens: local, layer split, and disaggregated (prefill on the rpc
        host, KV cache over the link, decode on the head), and which wins.

        Examples:
          sudo linkctl probe --profile dgx-mac
          linkctl estimate --model /models/qwen3-235b-q4.gguf --ctx 32768 --depth 8192
          linkctl estimate --model /models/70b.gguf --rtt-us 150 --throughput-gbps 9.4
        """
        from linkctl.estimate.run import parse_split, run_estimate, served_for

        prof, path = load(profile)
        est = run_estimate(
            prof,
            model,
            probe=probe,
            split=parse_split(split),
            ctx=ctx,
            prompt=prompt,
            rtt_us=rtt_us,
            throughput_gbps=throughput_gbps,
            query_rpc=query_rpc,
            calibration=calibration or [],
            depth=depth,
        )
        de = None
        if prof.rpc_hosts:
            from linkctl.estimate.ttft import predict_for_profile

            de = predict_for_profile(
                prof,
                model,
                prompt=prompt,
                output=output,
                probe=probe,
                rtt_us=rtt_us,
                throughput_gbps=throughput_gbps,
                calibration=calibration or [],
                ctx=ctx,
            )
        from linkctl.estimate import report

        # What llama-server delivers beside the llama-bench figures (the serving overhead).
        sv = served_for(prof, est)
        if json_out:
            emit_json(report.as_json(est, de) | {"llama_server": sv.as_dict()}, path)
        else:
            report.render(est)
            report.render_served(sv)
            if de:
                report.render_serving(de)

    @app.command("calibrate")
    def calibrate_cmd(
        model: Annotated[
            list[Path] | None,
            typer.Option(
                "--model",
                "-m",
                help="A .gguf to measure on (repeatable). A quantized one (Q4_K_M, Q8_0, "
                "...) is timed for its weight types' read rate, which estimate then uses on "
                "this host; unquantized ones join the two-term solve. Generated F32 models "
                "are added until two differ in shape (default: two generated models only).",
                show_default=False,
            ),
        ] = None,
        profile: ProfileOpt = None,
        host: HostOpt = None,
        tokens: Annotated[int, typer.Option("--tokens", help="Decode tokens to time.")] = 64,
        runs: Annotated[
            int, typer.Option("--runs", help="Timed requests (the median is kept).")
        ] = 5,
        threads: Annotated[
            int | None,
            typer.Option(
                "--threads",
                "-t",
                help="llama.cpp threads (default: llama.cpp's).",
                show_default=False,
            ),
        ] = None,
        rpc: Annotated[
            bool,
            typer.Option(
                "--rpc",
                help="Also measure the fixed per-token cost of one RPC boundary: the same "
                "model through a ggml-rpc-server on 127.0.0.1.",
            ),
        ] = False,
        bin_dir: LlamaBinDirOpt = None,
        dry_run: Annotated[
            bool,
            typer.Option(
                "--dry-run",
                help="Print the plan (models, runs, threads, CPU quota, where the result "
                "goes) and the exact commands; run and store nothing.",
            ),
        ] = False,
        json_out: JsonOpt = False,
    ) -> None:
        """Measure this host's decode terms (fixed cost per block and effective bandwidth,
        solved from two models of different shape), the read rate of the weight types of
        the model you will serve (--model it) and prefill compute with llama-server,
        and store them so `linkctl estimate` uses them instead of the catalog, in the
        state directory's calibration.json (once root's /var/lib/linkctl exists, with sudo).

        Example: linkctl calibrate --model /models/llama-8b-q4_k_m.gguf --rpc

        Add --dry-run first to see what it will run and where the result goes.
        """
        from linkctl.calibrate.plan import plan, render_plan
        from linkctl.core.privilege import require_writable_state

        if not dry_run:
            require_writable_state("the calibration (calibration.json, calibrate/)")
        prof, path = load(profile)
        p = plan(
            prof,
            model or [],
            host=host,
            tokens=tokens,
            runs=runs,
            threads=threads,
            rpc=rpc,
            bin_dir=bin_dir,
        )
        if dry_run:
            if json_out:
                emit_json(p.as_json(), path)
            else:
                render_plan(p)
            return
        from linkctl.calibrate.measure import measure
        from linkctl.calibrate.solve import as_json, record, render_calibration
        from linkctl.core.log import speaker
        from linkctl.core.records import save_calibration

        rec = record(p, measure(p, say=speaker("calibrate")))
        out = as_json(rec, save_calibration(p.host, rec))
        if json_out:
            emit_json(out, path)
        else:
            render_calibration(out)
