"""fit's figure: one bar per mode per device, the largest training batch predicted there, the batch asked as a
line; the cheapest mode that fits on each device outlined."""
from __future__ import annotations


def plot_fit(result):
    import pandas as pd
    from matplotlib.figure import Figure

    t = result.full_table().set_index("mode")
    columns = list(result.devices())
    cheapest = result.cheapest()
    fig = Figure(figsize=(max(11, 0.25 * len(t) * len(columns)), 4.5), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(t)
    for i, (mode, row) in enumerate(t.iterrows()):
        xs = [x + i * width for x in range(len(columns))]
        values = [int(row[c]) if pd.notna(row[c]) else 0 for c in columns]  # <NA>: the mode doesn't run there
        bars = ax.bar(xs, [max(v, 0.5) for v in values], width, label=mode, color=f"C{i % 10}",
                      hatch="//" if row["checkpointing"] == "on" else None)
        for bar, column in zip(bars, columns):
            if cheapest[column] is not None and cheapest[column].name == mode:
                bar.set_edgecolor("k")
                bar.set_linewidth(2)
    ax.axhline(result.batch_size, color="k", ls="--", lw=1, label=f"batch asked ({result.batch_size})")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(columns))],
                  [f"this device\n({result.metadata['device_name'][:20]})",
                   *(c.replace(" (predicted)", "") + "\n(predicted)" for c in columns[1:])], fontsize=8)
    ax.set(yscale="log", ylabel=f"largest training batch at T={result.seq_len} (predicted)")
    ax.legend(fontsize=6, ncol=3, loc="upper left")
    ax.set_title("one bar per mode per device; outlined: the cheapest mode that fits the batch asked there; "
                 "hatched: checkpointing", fontsize=8)
    fig.suptitle(result.headline()[:170], fontsize=8)
    return fig
