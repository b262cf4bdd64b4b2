"""
Draws a run's training curves from its metrics.jsonl into one PNG.

    python -m machinery.plot runs/tiny_cpu                     # writes runs/tiny_cpu/curves.png
    python -m machinery.plot runs/t08/metrics.jsonl -o t08.png

Panels, against the RL step (a panel with no data is left out):
  1. reward         rollout/reward per step (thin) and its moving average (thick);
  2. eval accuracy  every eval/<set>/accuracy and eval/<set>/greedy_accuracy (or eval/accuracy), markers;
  3. mismatch / KL  train/mismatch_k3 between learner and generator, and train/kl to the reference;
  4. skipped steps  train/skipped_steps, the stage's running count of steps with a non-finite loss or gradient;
  5. time           perf/step_s and perf/learner_wait_s, with perf/generator_idle on the right axis;
  6. warm-up        train/loss and train/indexer_kl of the dsa_warmup and sft stages, against their own step.

Matplotlib is an optional extra (pip install -e ".[plot]"). Reading the file (parse_metrics) needs only
the standard library, so the tests check it where matplotlib is not installed.
"""
import argparse
import json
import math
import os
import re
import sys

WARMUP_STAGES = ("dsa_warmup", "sft")
# Old runs log eval/accuracy; newer ones one set per key: eval/<set>/accuracy, eval/<set>/greedy_accuracy.
EVAL_KEY = re.compile(r"^eval/(?:(.+)/)?(accuracy|greedy_accuracy)$")
INSTALL_HINT = 'plotting needs matplotlib: pip install -e ".[plot]"'


# ----------------------------------------------------------------------------- reading (no matplotlib)


def metrics_path(path):
    """A run directory means its metrics.jsonl; anything else is taken as the file itself."""
    return os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path


def parse_metrics(lines):
    """Lines of a metrics.jsonl -> {stage: {key: (steps, values)}}, steps ascending.

    Every numeric key of a row becomes a series of its stage, indexed by the row's "step"; a non-finite
    value (the loss of a skipped step) becomes NaN, a gap in its curve. Unreadable lines are skipped:
    the last line of a killed run may be cut short. A step that occurs twice (a run resumed from an
    earlier checkpoint redoes steps) keeps the later value, key by key, so that a row holding only eval
    keys adds to its step rather than erasing the training metrics logged there.
    """
    by_step = {}  # (stage, key) -> {step: value}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a cut line, or a stray non-JSON line
            continue
        if not isinstance(row, dict):
            continue
        stage, step = row.get("stage"), row.get("step")
        if not isinstance(stage, str) or not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, value in row.items():
            # bool is an int in Python, but a flag logged as true/false is not a curve.
            if key in ("stage", "step") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            value = float(value)
            by_step.setdefault((stage, key), {})[step] = value if math.isfinite(value) else math.nan
    series = {}
    for (stage, key), points in by_step.items():
        steps = sorted(points)
        series.setdefault(stage, {})[key] = (steps, [points[s] for s in steps])
    return series


def read_metrics(path):
    """parse_metrics of a file. errors="replace": a line of stray bytes fails to parse like any cut line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_metrics(f)


def eval_keys(keys):
    """The eval accuracy keys among keys -> [(key, set name or "", "sampled" | "greedy")], sorted by set."""
    found = []
    for key in keys:
        m = EVAL_KEY.match(key)
        if m:
            found.append((key, m.group(1) or "", "greedy" if m.group(2) == "greedy_accuracy" else "sampled"))
    return sorted(found, key=lambda k: (k[1], k[2] != "sampled"))


def moving_average(values, window):
    """Trailing mean over the last `window` values (fewer at the start); NaNs are left out of the mean."""
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)]
        out.append(sum(part) / len(part) if part else math.nan)
    return out


def smoothing_window(n):
    """About a tenth of the run, so that a 20-step run and a 2000-step run both get a readable trend."""
    return max(1, min(50, n // 10))


# ----------------------------------------------------------------------------- drawing


# Where each panel finds its data: the RL stage's keys (panels 1-5), the warm-up stages' (panel 6).
MISMATCH_KEYS = ("train/mismatch_k3", "train/kl")
TIME_KEYS = ("perf/step_s", "perf/learner_wait_s", "perf/generator_idle")
WARMUP_KEYS = ("train/loss", "train/indexer_kl")


def panels(series):
    """The titles of the panels that series (from parse_metrics) has data for, in drawing order."""
    rl = series.get("rl", {})
    present = {
        "Reward": "rollout/reward" in rl,
        "Eval accuracy": bool(eval_keys(rl)),
        "Mismatch and KL": any(key in rl for key in MISMATCH_KEYS),
        "Skipped steps": "train/skipped_steps" in rl,
        "Time per RL step": any(key in rl for key in TIME_KEYS),
        "Warm-up stages": any(key in series.get(stage, {}) for stage in WARMUP_STAGES for key in WARMUP_KEYS),
    }
    return [name for name, ok in present.items() if ok]


def plot(series, out, title=None):
    """Draws the panels that series has data for into the PNG `out`. Returns their titles (none: no file)."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed, and no window opens on a desktop
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, MaxNLocator, PercentFormatter

    rl = series.get("rl", {})
    warm = {stage: series[stage] for stage in WARMUP_STAGES if stage in series}
    colors = plt.get_cmap("tab10").colors

    def draw(ax, key, **style):
        steps, values = rl[key]
        return ax.plot(steps, values, **style)[0]

    def log_if_positive(ax, keys, source):
        # Log scale shows mismatch and KL over their orders of magnitude, but has no place for 0 (a
        # first on-policy step, a run with no reference), so those keep a linear axis.
        values = [v for key in keys if key in source for v in source[key][1] if not math.isnan(v)]
        if values and min(values) > 0:
            ax.set_yscale("log")

    def make_room(ax, rows):
        """Raises the top of the y axis so that a legend of `rows` rows sits above the curves, not on them.
        Returns the fraction of the height kept free."""
        room = min(0.45, 0.06 + 0.075 * rows)
        lo, hi = ax.get_ylim()
        if ax.get_yscale() == "log":  # the same share of the height: extend in decades, not in values
            lo, hi = math.log10(lo), math.log10(hi)
            ax.set_ylim(10 ** lo, 10 ** (lo + (hi - lo) / (1 - room)))
        else:
            ax.set_ylim(lo, lo + (hi - lo) / (1 - room))
        return room

    def reward(ax):
        steps, values = rl["rollout/reward"]
        window = smoothing_window(len(steps))
        ax.set_ylabel("mean reward")
        if window == 1:  # under 20 steps there is no trend to pull out of the noise: the steps themselves
            ax.plot(steps, values, color=colors[0], lw=1.6)
            return
        ax.plot(steps, values, color=colors[0], lw=0.8, alpha=0.35, label="per step")
        ax.plot(steps, moving_average(values, window), color=colors[0], lw=2.2,
                label=f"moving average ({window} steps)")
        ax.legend(loc="best")

    def eval_accuracy(ax):
        found = eval_keys(rl)
        sets = sorted({name for _, name, _ in found})
        for key, name, kind in found:
            color = colors[sets.index(name) % len(colors)]
            greedy = kind == "greedy"
            label = f"{name} · {kind}" if name else kind
            draw(ax, key, color=color, ls="--" if greedy else "-", marker="s" if greedy else "o", ms=4, label=label)
        top = max((v for key, _, _ in found for v in rl[key][1] if not math.isnan(v)), default=0.0)
        ax.set_ylim(0, min(1.02, max(0.1, top * 1.15)))  # from 0, so a climb reads as the share it is
        ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
        ax.set_ylabel("accuracy")
        # Accuracy usually climbs towards the upper right; "best" finds the corner the curves leave free.
        ax.legend(loc="best")

    def mismatch(ax):
        keys = [k for k in MISMATCH_KEYS if k in rl]
        labels = {"train/mismatch_k3": "mismatch k3 (learner vs generator)", "train/kl": "KL to reference"}
        for i, key in enumerate(keys):
            draw(ax, key, color=colors[3 + i], lw=1.3, label=labels[key])
        if "train/kl" not in rl:  # no reference model: the title names only what is drawn
            ax.set_title("Learner / generator mismatch")
        log_if_positive(ax, keys, rl)
        ax.set_ylabel("per token")
        make_room(ax, len(keys))
        ax.legend(loc="upper right")

    def skipped(ax):
        steps, values = rl["train/skipped_steps"]
        # clip_on, zorder: a count that stays at 0 is drawn over the x axis, not hidden behind it.
        ax.plot(steps, values, color=colors[3], lw=1.6, drawstyle="steps-post", clip_on=False, zorder=3)
        if "train/skipped" in rl:  # mark the skipped steps themselves, where the count goes up
            s, v = rl["train/skipped"]
            count = dict(zip(steps, values))
            at = [step for step, flag in zip(s, v) if flag > 0]
            ax.plot(at, [count.get(step, math.nan) for step in at], "x", color=colors[3], ms=6)
        total = max((v for v in values if not math.isnan(v)), default=0.0)
        ax.set_ylim(0, max(1.0, total * 1.15))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("steps (cumulative)")
        if total == 0:  # a flat line at 0 reads as "no data"; say it outright
            ax.text(0.5, 0.5, "no skipped steps", transform=ax.transAxes, ha="center", va="center", color="0.45")

    def timing(ax):
        handles = []
        if "perf/step_s" in rl:
            handles.append(draw(ax, "perf/step_s", color=colors[0], lw=1.3, label="step time"))
        if "perf/learner_wait_s" in rl:
            handles.append(draw(ax, "perf/learner_wait_s", color=colors[0], lw=1.0, ls="--",
                                label="learner wait"))
        ax.set_ylabel("seconds")
        # RL step 1 also waits for the first batch to be generated from scratch: a spike that would
        # flatten every later step, so the axis fits the later steps and lets it run off the top.
        later = [v for key in ("perf/step_s", "perf/learner_wait_s") if key in rl
                 for s, v in zip(*rl[key]) if s > 1 and not math.isnan(v)]
        if len(later) < 2:
            later = [v for key in ("perf/step_s", "perf/learner_wait_s") if key in rl
                     for v in rl[key][1] if not math.isnan(v)]
        ax.set_ylim(0, max(later, default=0) or 1)
        room = make_room(ax, 2)
        if "perf/generator_idle" in rl:
            # A fraction, not seconds: its own axis on the right, with the right spine back on.
            right = ax.twinx()
            right.spines["right"].set_visible(True)
            handles.append(draw(right, "perf/generator_idle", color=colors[2], lw=1.3, label="generator idle"))
            right.set_ylim(0, 1 / (1 - room))  # the same room for the legend as on the left
            right.yaxis.set_major_locator(FixedLocator([0, 0.25, 0.5, 0.75, 1]))
            right.spines["right"].set_bounds(0, 1)  # the axis ends at 100%; above it is the legend's room
            right.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
            right.set_ylabel("generator idle", color=colors[2], y=(1 - room) / 2)  # centred on 0-100%
            right.tick_params(axis="y", colors=colors[2])
            right.grid(False)
        ax.legend(handles=handles, loc="upper right", ncols=2)

    def warmup(ax):
        for i, (stage, metrics) in enumerate(warm.items()):
            for key, ls, name in zip(WARMUP_KEYS, ("-", "--"), ("loss", "indexer KL")):
                if key in metrics:
                    ax.plot(*metrics[key], color=colors[4 + i], ls=ls, lw=1.3, label=f"{stage} {name}")
        log_if_positive(ax, WARMUP_KEYS, {  # every stage's values together
            key: ([], [v for m in warm.values() for v in m.get(key, ([], []))[1]]) for key in WARMUP_KEYS})
        ax.set_xlabel("step within the stage")
        ax.set_ylabel("loss / KL")
        make_room(ax, len(ax.get_lines()))
        ax.legend(loc="upper right")

    draw_panel = {"Reward": reward, "Eval accuracy": eval_accuracy, "Mismatch and KL": mismatch,
                  "Skipped steps": skipped, "Time per RL step": timing, "Warm-up stages": warmup}
    names = panels(series)
    if not names:
        return []

    # 3 columns fill a 12-inch-wide figure; 4 panels look better as 2 x 2, fewer as one row.
    n = len(names)
    cols = 2 if n == 4 else min(3, n)
    rows = math.ceil(n / cols)
    style = {"axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
             "axes.titlesize": 11, "axes.titleweight": "bold", "axes.labelsize": 9, "xtick.labelsize": 8,
             "ytick.labelsize": 8, "legend.fontsize": 8, "legend.frameon": False}
    with plt.rc_context(style):
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 4 * rows), squeeze=False)
        flat = list(axes.flat)
        for ax, name in zip(flat, names):
            ax.set_title(name)
            ax.set_xlabel("RL step")  # the warm-up panel sets its own
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            draw_panel[name](ax)
        for ax in flat[n:]:
            ax.remove()
        if title:
            fig.suptitle(title, fontsize=13)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig.savefig(out, dpi=120, format="png")  # format: "-o out" writes out, not out.png
        plt.close(fig)
    return names


# ----------------------------------------------------------------------------- command line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory, or its metrics.jsonl")
    parser.add_argument("-o", "--output", help="the PNG to write, or a folder for curves.png "
                        "(default: curves.png next to metrics.jsonl)")
    args = parser.parse_args(argv)

    path = metrics_path(args.run)
    if not os.path.isfile(path):
        sys.exit(f"error: {path}: no such file or directory")
    try:
        series = read_metrics(path)
    except OSError as e:
        sys.exit(f"error: {path}: {e.strerror or e}")
    if not series:
        sys.exit(f'error: {path}: no usable rows (JSON lines with "stage" and "step")')
    if not panels(series):
        sys.exit(f"error: {path}: nothing to plot (no reward, eval, mismatch, timing or warm-up metrics)")
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as e:
        # Missing outright: say how to get it. Present but broken (a missing dependency): say what broke.
        sys.exit(f"error: {INSTALL_HINT}" if e.name == "matplotlib" else f"error: cannot import matplotlib: {e}")
    except ImportError as e:
        sys.exit(f"error: cannot import matplotlib: {e}")

    out = args.output or os.path.join(os.path.dirname(path), "curves.png")
    if os.path.isdir(out):  # -o some/folder: curves.png in it
        out = os.path.join(out, "curves.png")
    run_dir = os.path.dirname(os.path.abspath(path))
    try:
        drawn = plot(series, out, title=os.path.basename(run_dir))
    except OSError as e:
        sys.exit(f"error: {out}: {e.strerror or e}")
    print(f"wrote {out}: {', '.join(drawn)}")


if __name__ == "__main__":
    main()
