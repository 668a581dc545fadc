"""Charts written beside a command's JSON (matplotlib, no display): speed-ups per workload and system (`specdec
bench`, `benchmarks/pair.py speed`), and pass curves (`specdec calibrate --plot`)."""
from __future__ import annotations


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def speedups(bars: dict[str, dict[str, float]], path: str, title: str, baseline: str = "target-only") -> None:
    """`bars`: system -> workload -> speed-up over `baseline` (None: not measured); grouped by workload."""
    plt = _pyplot()
    systems = list(bars)
    workloads = list(dict.fromkeys(w for b in bars.values() for w in b))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(workloads) * max(1, len(systems)) / 2), 4.2))
    width = 0.8 / max(1, len(systems))
    for i, name in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(workloads))]
        ys = [bars[name].get(w) or 0.0 for w in workloads]
        drawn = ax.bar(xs, ys, width, label=name)
        ax.bar_label(drawn, labels=[f"{y:.2f}" if y else "" for y in ys], fontsize=7, padding=1)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel(f"x {baseline}")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves(lines: dict[str, dict[int, float]], path: str, title: str) -> None:
    """`lines`: label -> {rows: ms}; each also against its own one-row pass, on a second axis."""
    plt = _pyplot()
    fig, (ms, rel) = plt.subplots(1, 2, figsize=(9, 3.8))
    for label, c in lines.items():
        rows = sorted(c)
        ms.plot(rows, [c[n] for n in rows], marker="o", label=label)
        rel.plot(rows, [c[n] / c[rows[0]] for n in rows], marker="o", label=label)
    for ax, unit in ((ms, "ms a pass"), (rel, "x its one-row pass")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def beside(json_path: str) -> str:
    """The chart's path beside a JSON result: x.json -> x.png."""
    return (json_path[:-5] if json_path.endswith(".json") else json_path) + ".png"


def training(curve: list[dict], epochs: list[dict], path: str, title: str) -> None:
    """`specdec distill`'s training: the loss every 50 steps, and the draft's agreement with the target's argmax
    (training batches every 50 steps; held out, by epoch, from the target's features and from its own)."""
    plt = _pyplot()
    fig, (loss, acc) = plt.subplots(1, 2, figsize=(9, 3.8))
    steps = [c["step"] for c in curve]
    loss.plot(steps, [c["loss"] for c in curve], linewidth=1)
    loss.set_xlabel("step")
    loss.set_ylabel("training loss")
    acc.plot(steps, [c["acc"] for c in curve], linewidth=0.8, alpha=0.5, label="training batch")
    per_epoch = len(curve) and steps[-1] / max(1, len(epochs))
    held = [(per_epoch * (i + 1), e["val"]) for i, e in enumerate(epochs) if "val" in e]
    if held:
        acc.plot([x for x, _ in held], [v["acc"] for _, v in held], "o-", label="held out, target features")
        acc.plot([x for x, _ in held], [v["acc2"] for _, v in held], "s-", label="held out, own features")
    acc.set_xlabel("step")
    acc.set_ylabel("argmax agreement")
    acc.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
