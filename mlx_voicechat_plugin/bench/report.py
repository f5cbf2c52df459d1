"""Rendering benchmark results: console table, Markdown, PNG plot."""

from __future__ import annotations

from pathlib import Path

STAGES = ("perception", "rnnt", "language", "tts", "codec", "total")


def streaming_table(results: dict) -> str:
    """Per-stage times with profiling on (stage boundaries evaluated, so work is serialised)."""
    lines = [
        "| checkpoint | stage | ours p50 ms | ours mean ms | upstream p50 ms | upstream mean ms | ours / upstream (mean) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in results.items():
        for stage in STAGES:
            ours, up = row["ours"][stage], row["upstream"][stage]
            ratio = ours["mean_ms"] / up["mean_ms"] if up["mean_ms"] else float("nan")
            lines.append(
                f"| {name} | {stage} | {ours['p50_ms']:.1f} | {ours['mean_ms']:.1f} | {up['p50_ms']:.1f} | "
                f"{up['mean_ms']:.1f} | {ratio:.2f} |"
            )
    return "\n".join(lines)


def summary_table(results: dict, floors: dict) -> str:
    """Headline: per-frame wall time with profiling off (mean / p50 / p95), both sides."""
    lines = [
        "| checkpoint | frames x runs | ours ms/frame mean (p50 / p95) | upstream ms/frame mean (p50 / p95) | speed-up | ours / upstream | ours RTF | host syncs/frame (ours, mean / max) | events identical | floor ms | ours / floor |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for name, row in results.items():
        floor = floors.get(name, {})
        floor_ms = floor.get("floor_ms", float("nan"))
        ours, up = row["ours_wall"], row["upstream_wall"]
        lines.append(
            f"| {name} | {row['frames_per_run']} x {row['repeats']} | "
            f"{ours['mean_ms']:.1f} ({ours['p50_ms']:.1f} / {ours['p95_ms']:.1f}) | "
            f"{up['mean_ms']:.1f} ({up['p50_ms']:.1f} / {up['p95_ms']:.1f}) | {row['speedup_mean']:.2f}x | "
            f"{row['ratio_mean']:.2f} | {row['ours_realtime_factor']:.2f} | "
            f"{row['ours_host_syncs']['mean']:.1f} / {row['ours_host_syncs']['max']} | {row['events_identical']} | "
            f"{floor_ms:.2f} | {ours['mean_ms'] / floor_ms:.1f} |"
        )
    return "\n".join(lines)


def offline_table(offline: dict) -> str:
    rows = offline["rows"]
    lines = [
        "| input s | frames | ours s | upstream cached s | upstream default s | default / ours | ids identical |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        default = row.get("upstream_default_s")
        ratio = f"{default / row['ours_s']:.1f}x" if default else "skipped (O(T^2))"
        default_text = f"{default:.1f}" if default else "-"
        identical = row["ids_identical_to_upstream_cached"] and row.get("ids_identical_to_upstream_default", True)
        lines.append(
            f"| {row['seconds']:g} | {row['frames']} | {row['ours_s']:.1f} | {row['upstream_cached_s']:.1f} | "
            f"{default_text} | {ratio} | {identical} |"
        )
    prompt = offline.get("silent_prompt_s")
    if prompt is not None:
        lines.append("")
        lines.append(
            f"The lengths run in this order on one freshly loaded model. Ours computes EAR-TTS's silent "
            f"audio prompt (a codec encode of ~3 s of zeros, {prompt:.1f} s here) once per loaded "
            f"model, so only its first turn pays it (the first row above); upstream pays it on "
            f"every turn."
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """Stacked per-stage mean frame time, ours vs upstream, per checkpoint. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(results)
    stages = STAGES[:-1]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(names)), 4.5))
    width = 0.38
    colors = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3"]
    for offset, side in ((-width / 2, "ours"), (width / 2, "upstream")):
        bottoms = [0.0] * len(names)
        for color, stage in zip(colors, stages):
            values = [results[n][side][stage]["mean_ms"] for n in names]
            ax.bar(
                [i + offset for i in range(len(names))], values, width, bottom=bottoms, color=color,
                label=stage if side == "ours" else None, edgecolor="white", hatch="" if side == "ours" else "//",
            )
            bottoms = [b + v for b, v in zip(bottoms, values)]
        for i, total in enumerate(bottoms):
            ax.text(i + offset, total + 1, side, ha="center", va="bottom", fontsize=8)
    ax.axhline(80.0, color="black", linestyle="--", linewidth=1, label="80 ms (real time)")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("mean ms per 80 ms frame")
    ax.set_title("Streaming stage times: ours (solid) vs upstream (hatched)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def machine_line(machine: dict) -> str:
    """One line naming the machine: CPU, instruction set, cores, memory, versions, device, CPU layer."""
    return (
        f"Machine: {machine['cpu']} ({machine.get('instruction_set', 'instruction set unknown')}), "
        f"{machine['cores']} cores, {machine['memory_gib']} GiB, {machine['platform']}, "
        f"Python {machine['python']}, MLX {machine['mlx']} ({machine['device']}); "
        f"{_layer(machine)}."
    )


def _layer(machine: dict) -> str:
    status = str(machine.get("cpu_layer", machine.get("native_kernels", "unknown")))
    return status if status.lower().startswith("cpu layer") else f"CPU layer: {status}"


def graph_table(graph: dict) -> str:
    """Per streamed frame: primitives, host evaluations and weight bytes, ours vs upstream."""
    lines = [
        "| checkpoint | frames | ours primitives/frame (max) | upstream primitives/frame (max) | ours / upstream "
        "| ours / upstream non-view primitives | ours evaluations/frame (max) | upstream evaluations/frame (max) "
        "| ours weight MB/frame | upstream weight MB/frame | ours / upstream tables MB |",
        "|---|---:|---:|---:|---:|---|---|---|---:|---:|---|",
    ]
    for name, row in graph.items():
        ours, up = row["ours"], row["upstream"]
        lines.append(
            f"| {name} | {ours['frames']} | {ours['primitives']:.0f} ({ours['primitives_max']}) | "
            f"{up['primitives']:.0f} ({up['primitives_max']}) | {row['primitives_ratio']:.2f} | "
            f"{ours['kernels']:.0f} / {up['kernels']:.0f} ({row['kernels_ratio']:.2f}) | "
            f"{ours['evaluations']:.1f} ({ours['evaluations_max']}) | {up['evaluations']:.1f} ({up['evaluations_max']}) | "
            f"{ours['weight_bytes'] / 1e6:.1f} | {up['weight_bytes'] / 1e6:.1f} | "
            f"{ours['table_bytes'] / 1e6:.1f} / {up['table_bytes'] / 1e6:.1f} |"
        )
    return "\n".join(lines)


def compile_table(results: dict, graph: dict) -> str:
    """Ours with compiled blocks on vs suspended, same run: wall ms/frame and primitives/frame.

    Empty when the run had no A/B (``--compile ab``)."""
    rows = [name for name, row in results.items() if "ours_wall_uncompiled" in row]
    if not rows:
        return ""
    lines = [
        "| checkpoint | compiled ms/frame mean (p50) | uncompiled ms/frame mean (p50) | compiled speed-up "
        "| compiled primitives/frame | uncompiled primitives/frame |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in rows:
        row = results[name]
        on, off = row["ours_wall"], row["ours_wall_uncompiled"]
        counts = graph.get(name, {})
        on_count = f"{counts['ours']['primitives']:.0f}" if "ours" in counts else "-"
        off_count = f"{counts['ours_uncompiled']['primitives']:.0f}" if "ours_uncompiled" in counts else "-"
        lines.append(
            f"| {name} | {on['mean_ms']:.1f} ({on['p50_ms']:.1f}) | {off['mean_ms']:.1f} ({off['p50_ms']:.1f}) | "
            f"{row['compile_speedup_mean']:.2f}x | {on_count} | {off_count} |"
        )
    return "\n".join(lines)
