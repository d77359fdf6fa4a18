"""Hyperparameter search: an Optuna study around `train`, on validation loss, with pruning.

Each trial trains a copy of the same initial weights; every evaluation's val loss is reported
to the trial so the pruner can stop a clearly worse one early. With `storage="sqlite:///x.db"`
the study lives in a database and running `search` again with the same name continues it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import pandas as pd

from ..adapter.adapter import resolve_model
from ..core.display import html_table
from ..core.errors import SearchStorageError, TrainingDiverged, TrainingOutOfMemory, one_line
from ..core.files import jsonable
from ..core.plotting import integer_axis
from ..core.precision import canonical_precision
from ..core.progress import interactive
from ..core.results import Result, run_metadata
from ..core.settings import check_fields, check_switch, merge, setting
from ..core.threads import chooses_threads
from ..models.builtins import DEFAULT_MODEL
from ..training.config import TrainConfig
from ..training.loop import train

if TYPE_CHECKING:
    import optuna


def _trial_defaults() -> TrainConfig:
    """A trial is a short run, evaluated often so the pruner can stop a bad one early; its bar stays off
    (the study has its own)."""
    return TrainConfig(max_steps=60, eval_every=10, progress=False)


@dataclass
class SearchConfig:
    """The Optuna study around `train`, and its trials' fixed training settings (`trial`, a TrainConfig)."""

    n_trials: int = setting(8, "finished trials the study should hold", flag="trials", low=1)
    timeout: float | None = setting(None, "stop starting trials after this many seconds", above=0)
    storage: str | None = setting(None, "e.g. sqlite:///study.db: persist the study; the same study name "
                                        "continues it")
    study_name: str = setting("tier_utils", "the study's name in its storage")
    sampler_seed: int = setting(0, "the TPE sampler's seed", low=0)
    progress: bool = setting(True, "the study's progress bar (a terminal's; Optuna's bar redraws)")
    trial: TrainConfig = setting(factory=_trial_defaults, help="each trial's settings, before the searched ones")

    def __post_init__(self):
        check_switch(self, "progress")
        if not isinstance(self.trial, TrainConfig):
            raise ValueError(f"trial must be a TrainConfig, got {type(self.trial).__name__}")
        if not self.trial.evaluates:
            raise ValueError("search ranks and prunes its trials by validation loss, which a trial without "
                             "validation (eval_every=never or val_fraction=0) never measures: keep validation")
        self.trial = replace(self.trial, progress=False)
        check_fields(self)

    @classmethod
    def of(cls, config, overrides: dict) -> SearchConfig:
        """`config` (a SearchConfig, a dict of its fields or None) with `overrides`: names of its own fields,
        else of its trials' TrainConfig; a name that is neither is refused."""
        own = {f.name for f in fields(cls)}
        cfg = merge(cls, config, {k: v for k, v in overrides.items() if k in own}, "search")
        trial = merge(TrainConfig, cfg.trial, {k: v for k, v in overrides.items() if k not in own},
                      "search or trial training")
        return replace(cfg, trial=trial)


# name -> (kind, *args). Kinds: "log" (lo, hi), "float" (lo, hi), "int" (lo, hi), "choice" ([values]).
DEFAULT_SPACE = {
    "lr": ("log", 1e-4, 3e-3),
    "weight_decay": ("float", 0.0, 0.2),
    "warmup_steps": ("int", 0, 20),
    "batch_size": ("choice", [8, 16, 32]),
}
_KINDS = ("log", "float", "int", "choice")
# optuna is imported where a study is used, not with the package: `import tier_utils` stays light.


def _check_space(space: dict) -> dict:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for name, spec in space.items():
        if name not in fields:
            raise ValueError(f"search space key {name!r} is not a TrainConfig field; use some of: {sorted(fields)}")
        if not isinstance(spec, tuple) or not spec or spec[0] not in _KINDS:
            raise ValueError(f"search space {name!r} must be a tuple starting with one of {_KINDS}, "
                             f"e.g. ('log', 1e-4, 3e-3) or ('choice', [8, 16])")
        kind, args = spec[0], spec[1:]
        if kind == "choice":
            if len(args) != 1 or not isinstance(args[0], (list, tuple)) or not args[0]:
                raise ValueError(f"search space {name!r}: ('choice', [values]) needs a non-empty list")
            if name == "precision":
                for p in args[0]:
                    canonical_precision(p)
            continue
        numbers = len(args) == 2 and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
        if not numbers or not args[0] <= args[1]:
            raise ValueError(f"search space {name!r}: ({kind!r}, lo, hi) needs two numbers with lo <= hi, got {args}")
        if kind == "log" and args[0] <= 0:
            raise ValueError(f"search space {name!r}: a log range must start above 0, got {args[0]}; "
                             f"e.g. ('log', 1e-5, {args[1]})")
        if kind == "int" and not all(isinstance(a, int) for a in args):
            raise ValueError(f"search space {name!r}: ('int', lo, hi) needs whole numbers, got {args}")
    return space


def _suggest(trial: optuna.Trial, space: dict) -> dict:
    params = {}
    for name, (kind, *args) in space.items():
        if kind == "log":
            params[name] = trial.suggest_float(name, args[0], args[1], log=True)
        elif kind == "float":
            params[name] = trial.suggest_float(name, args[0], args[1])
        elif kind == "int":
            params[name] = trial.suggest_int(name, args[0], args[1])
        else:
            params[name] = trial.suggest_categorical(name, list(args[0]))
    return params


def _changes_html(base: TrainConfig, best: TrainConfig) -> str:
    changed = [(f.name, getattr(base, f.name), getattr(best, f.name)) for f in dataclasses.fields(best)
               if getattr(base, f.name) != getattr(best, f.name)]
    table = pd.DataFrame([(name, _setting(new)) for name, _, new in changed], columns=["setting", "best trial"])
    return html_table(table, f"TrainConfig: the trial config with the {len(changed)} setting(s) the search "
                             "changed; train(model, config=study.best_config) runs it")


def _setting(value):
    return f"{value:.3g}" if isinstance(value, float) else value


def _ran_on(s) -> dict:
    """What a trial trained: its model, data and tokenizer, and how it held the model (memory settings)."""
    return {"model": s.model, "data": s.data, "tokenizer": s.tokenizer, "memory": s.memory["describe"]}


class SearchResult(Result):
    def __init__(self, study: optuna.Study, base_config: TrainConfig, meta: dict):
        self.study, self.base_config, self.meta = study, base_config, meta

    @property
    def table(self) -> pd.DataFrame:
        rows = []
        for t in self.study.trials:
            duration = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete else None
            last_step = max(t.intermediate_values) if t.intermediate_values else None
            rows.append({"trial": t.number, **t.params, "val_loss": t.value, "state": t.state.name,
                         "last_reported_step": last_step, "duration_s": duration,
                         "diverged": t.user_attrs.get("diverged"),
                         "out_of_memory": t.user_attrs.get("out_of_memory")})
        return pd.DataFrame(rows)

    @property
    def ran_on(self) -> dict | None:
        """The model, data, tokenizer and memory settings the trials trained (None: no trial finished)."""
        return next((t.user_attrs["ran_on"] for t in self.study.trials if "ran_on" in t.user_attrs), None)

    def summary_line(self) -> str:
        """"search: 8 trials (6 COMPLETE, 2 PRUNED) of TinyGPT on ... (full fine-tune), best trial 3: val loss 2.1
        with lr=..."."""
        best = self.to_json()["best"]
        states = self.table["state"].value_counts() if len(self.study.trials) else {}
        on, count = self.ran_on, len(self.study.trials)
        line = (f"search: {count} trial{'s' if count != 1 else ''} ("
                + ", ".join(f"{n} {state}" for state, n in dict(states).items()) + ")"
                + (f" of {on['model']} on {on['data']} ({on['memory']})" if on else ""))
        if best is None:
            return line + ", none completed"
        params = ", ".join(f"{k}={_setting(v)}" for k, v in best["params"].items())
        return line + f", best trial {best['trial']}: val loss {best['val_loss']:.4f} with {params}"

    @property
    def best_config(self) -> TrainConfig:
        """The base config with the best trial's parameters: ready for `train(model, config=...)`."""
        import optuna

        completed = [t for t in self.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if not completed:
            raise ValueError("no trial completed yet; run more trials or widen the search space")
        config = dataclasses.replace(self.base_config, **self.study.best_params)
        # A notebook shows it as what the search changed, not as one long TrainConfig(...) line; a partial of a
        # module function, so the config still pickles (torchrun, spawn).
        config._repr_html_ = functools.partial(_changes_html, self.base_config, config)
        return config

    def plot(self, kind: str = "history"):
        """kind="history": val loss per trial and best so far; kind="importances": fANOVA importances."""
        import matplotlib
        import matplotlib.pyplot as plt
        import optuna
        from optuna.visualization import matplotlib as ovm

        if kind not in ("history", "importances"):
            raise ValueError(f"unknown plot {kind!r}; use 'history' or 'importances'")
        if kind == "importances":
            done = [t for t in self.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
            if len(done) < 2:
                raise ValueError("parameter importances need at least 2 completed trials; run more trials")
        # rc_context: Optuna switches matplotlib to its ggplot style, which would restyle every later plot.
        with warnings.catch_warnings(), matplotlib.rc_context():
            # Optuna marks its matplotlib plots experimental; the warning says nothing to our users.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            draw = ovm.plot_optimization_history if kind == "history" else ovm.plot_param_importances
            ax = draw(self.study)
        fig = ax.figure
        if kind == "history":  # Optuna's generic names, said in this study's terms
            ax.set_ylabel("validation loss")
            ax.set_xlabel("trial")
            integer_axis(ax.xaxis)
        plt.close(fig)  # hand back the figure only: pyplot would show it a second time in a notebook
        return fig

    def to_json(self) -> dict:
        states = self.table["state"].value_counts().to_dict() if len(self.study.trials) else {}
        best = None
        try:
            best = {"trial": self.study.best_trial.number, "val_loss": self.study.best_value,
                    "params": self.study.best_params}
        except ValueError:
            pass
        return jsonable({"study_name": self.study.study_name, "n_trials": len(self.study.trials),
                         "states": states, "best": best, "ran_on": self.ran_on, "trials": self.table,
                         "meta": self.meta})


class _NoOutOfMemoryTraceback(logging.Filter):
    """Optuna logs a caught trial error with its traceback; an out-of-memory trial's line says it all."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], TrainingOutOfMemory):
            record.exc_info = None
        return True


@contextlib.contextmanager
def _one_line_out_of_memory():
    """Optuna's "Trial N failed ... TrainingOutOfMemory(...)" warning on one line, during one search only. The
    filter sits on the logger that writes it (a parent's filters do not see its children's records)."""
    logger, quiet = logging.getLogger("optuna.study._optimize"), _NoOutOfMemoryTraceback()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _open_study(study_cfg: SearchConfig, pruner, sampler) -> optuna.Study:
    """The study to add trials to: new, or continued from `storage` (a bad URL or a maximizing study: one line)."""
    import optuna

    optuna.logging.set_verbosity(logging.WARNING)  # our table says what each trial did
    try:
        study = optuna.create_study(
            study_name=study_cfg.study_name, storage=study_cfg.storage, direction="minimize", load_if_exists=True,
            pruner=pruner or optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
            sampler=sampler or optuna.samplers.TPESampler(seed=study_cfg.sampler_seed),
        )
    except Exception as exc:  # SQLAlchemy/Optuna raise many types for a bad URL or an unreadable file
        if study_cfg.storage is None:
            raise
        raise SearchStorageError(f"cannot open study storage {study_cfg.storage!r} ({one_line(exc)}); "
                                 "use e.g. sqlite:///runs/study.db in a folder that exists") from exc
    if study.direction != optuna.study.StudyDirection.MINIMIZE:
        raise SearchStorageError(f"study {study_cfg.study_name!r} in {study_cfg.storage} maximizes; a search "
                                 "minimizes validation loss, so give a new study_name")
    return study


@chooses_threads  # the run's torch thread count, chosen as it starts
def search(model=DEFAULT_MODEL, data=None, config: SearchConfig | dict | None = None, *,
           model_kwargs: dict | None = None, space: dict | None = None,
           pruner: optuna.pruners.BasePruner | None = None, sampler: optuna.samplers.BaseSampler | None = None,
           start_with: list[dict] | None = None, **overrides) -> SearchResult:
    """Search `space` (default: lr, weight decay, warm-up, batch size) minimising validation loss.

    `config` (a SearchConfig) and overrides naming its fields (n_trials, timeout, storage, study_name,
    sampler_seed, progress) shape the study; `n_trials` counts finished (complete or pruned) trials in it, so
    a continued study with storage runs only what is left. Overrides naming TrainConfig fields set the trials'
    fixed settings (`SearchConfig.trial`: short runs evaluated often); any other name is refused.
    `start_with`: parameter dicts to try first (e.g. your current settings), before the sampler's.
    A trial whose training diverges ends PRUNED with the reason in its `diverged` column; one that runs out of
    memory ends FAIL with train's line (what fits) in its `out_of_memory` column, and the study goes on.
    """
    import optuna

    study_cfg = SearchConfig.of(config, overrides)
    base = study_cfg.trial
    space = _check_space(dict(DEFAULT_SPACE if space is None else space))
    adapter = resolve_model(model, **(model_kwargs or {}))  # fails here, once, on a model the trials could not drive
    adapter.require_trainable()
    adapter.check_forward()  # a model that cannot run fails once, in one line, not in every trial
    study = _open_study(study_cfg, pruner, sampler)
    done = sum(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in study.trials)
    for params in start_with or ():
        study.enqueue_trial(params, skip_if_exists=True)

    def objective(trial: optuna.Trial) -> float:
        params = _suggest(trial, space)
        # with loggers in the config, each trial is one logged run, named after it
        run_name = f"{base.log_run_name or study_cfg.study_name}-trial-{trial.number}"
        # A trial is judged on its val loss alone: no comparison with its base (its time goes to more trials).
        cfg = dataclasses.replace(base, **params, log_run_name=run_name, compare_base=False)

        def report(step: int, metrics: dict) -> None:
            trial.report(metrics["val_loss"], step)
            if trial.should_prune():
                raise optuna.TrialPruned(f"val loss {metrics['val_loss']:.4f} at step {step} is worse than "
                                         "the median of earlier trials")

        try:
            result = train(adapter.copied(), data, cfg, on_eval=report)
        except TrainingDiverged as exc:
            # A result about these settings, not an error: the study goes on, and a pruned trial
            # (unlike a failed one) tells the sampler this region is bad.
            trial.set_user_attr("diverged", str(exc))
            raise optuna.TrialPruned(f"diverged: {exc}") from exc
        except TrainingOutOfMemory as exc:  # failed for memory: train's line (what fits) kept with the trial
            trial.set_user_attr("out_of_memory", str(exc))
            raise
        if result.interrupted:
            raise KeyboardInterrupt  # the study keeps this trial as FAIL; a rerun continues after it
        trial.set_user_attr("ran_on", _ran_on(result.summary))  # kept in the storage: a continued study says it too
        return result.summary.val_loss

    _optimize(study, objective, study_cfg, study_cfg.n_trials - done)
    return SearchResult(study, base, run_metadata(base.device))


def _optimize(study: optuna.Study, objective, study_cfg: SearchConfig, trials: int) -> None:
    """`trials` more trials of `objective` (none: the study has its n_trials already). A trial out of memory ends
    FAIL, said in one line, and the study goes on. Optuna's bar redraws: terminals only."""
    if trials <= 0:
        return
    with _one_line_out_of_memory():
        study.optimize(objective, n_trials=trials, timeout=study_cfg.timeout, catch=(TrainingOutOfMemory,),
                       show_progress_bar=study_cfg.progress and interactive())
