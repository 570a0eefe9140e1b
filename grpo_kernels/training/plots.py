"""The run's figure, ``curves.png``: reward, accuracy, loss, KL, entropy and the malformed share over the GRPO
steps, from the metrics records (matplotlib, the ``train`` extra)."""

from __future__ import annotations

from . import require_train_extra


def plot_curves(records: list[dict], path: str) -> None:
    """``curves.png`` of a run's metrics records (``curves_figure``)."""
    curves_figure(records).savefig(path, dpi=100, bbox_inches="tight")


def curves_figure(records: list[dict]):
    """Three panels over the GRPO steps (integer ticks), each with a title, axis labels and its legend outside the
    plot: reward and accuracy (the held-out evaluations as marked, labelled points: a short run has two); the loss,
    the KL to the reference and the entropy (each on its own scale: the loss near 0, the KL in hundredths); the
    malformed share, sampled and held-out. Below them the warm-up's result, where there was one."""
    require_train_extra("curves.png")
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no interactive backend
    from matplotlib.ticker import MaxNLocator

    train = [r for r in records if "reward" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    warm = next((r for r in records if "warmup_well_formed" in r), None)
    steps = [r["step"] for r in train]
    fig = Figure(figsize=(9, 10))
    top, middle, bottom = fig.subplots(3, 1, sharex=True)

    top.plot(steps, [r["reward"] for r in train], label="reward (sampled)", alpha=0.7)
    top.plot(steps, [r["accuracy"] for r in train], label="accuracy (sampled)", alpha=0.7)
    if evals:
        top.plot(
            [r["step"] for r in evals],
            [r["eval_accuracy"] for r in evals],
            "o--",
            color="black",
            ms=7,
            label="held-out accuracy (greedy)",
        )
        for r in evals:
            top.annotate(
                f"{r['eval_accuracy']:.0%}",
                (r["step"], r["eval_accuracy"]),
                textcoords="offset points",
                xytext=(0, 8),
                ha="center",
                fontsize=8,
            )
    top.set_title("Reward and accuracy")
    top.set_ylabel("share / reward")
    top.set_ylim(-0.02, 1.3)

    lines = []
    if train and "loss" in train[0]:
        lines += middle.plot(steps, [r["loss"] for r in train], label="loss", color="tab:blue")
    middle.set_ylabel("loss")
    if any("kl" in r for r in train):
        kl_axis = middle.twinx()
        lines += kl_axis.plot(
            steps, [r.get("kl", float("nan")) for r in train], label="KL to the reference", color="tab:red"
        )
        kl_axis.set_ylabel("KL", color="tab:red")
    if any("entropy" in r for r in train):
        entropy_axis = middle.twinx()
        entropy_axis.spines["right"].set_position(("axes", 1.12))
        lines += entropy_axis.plot(
            steps, [r.get("entropy", float("nan")) for r in train], label="entropy", color="tab:green"
        )
        entropy_axis.set_ylabel("entropy (nats)", color="tab:green")
    middle.set_title("Loss, KL and entropy (each on its own axis)")
    middle.legend(lines, [line.get_label() for line in lines], loc="upper left", bbox_to_anchor=(1.25, 1.0))

    if any("malformed" in r for r in train):
        bottom.plot(
            [r["step"] for r in train if "malformed" in r],
            [r["malformed"] for r in train if "malformed" in r],
            label="malformed (sampled)",
            alpha=0.7,
        )
    if any("eval_malformed" in r for r in evals):
        marked = [r for r in evals if "eval_malformed" in r]
        bottom.plot(
            [r["step"] for r in marked],
            [r["eval_malformed"] for r in marked],
            "s--",
            color="black",
            label="malformed (held-out)",
        )
    bottom.set_title("Malformed answers (not one of the prompt's numbers)")
    bottom.set_ylabel("share")
    bottom.set_xlabel("GRPO step")
    bottom.set_ylim(-0.02, 1.02)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axis in (top, middle, bottom):
        axis.grid(alpha=0.3)
    for axis in (top, bottom):
        if axis.get_legend_handles_labels()[0]:
            axis.legend(loc="upper left", bbox_to_anchor=(1.25, 1.0))  # beside the middle panel's right axes
    if warm is not None:
        fig.text(
            0.01,
            0.005,
            f"before step 1: the format warm-up, {warm['warmup_steps']} + "
            f"{warm.get('warmup_large_batch_steps', 0)} steps, {warm['warmup_well_formed']:.0%} of "
            f"sampled answers well-formed" + (" (below its target)" if warm.get("warmup_below_target") else ""),
            fontsize=8,
        )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    return fig
