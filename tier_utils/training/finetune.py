"""Fine-tuning around the training loop: the best evaluation so far (`best.pt`), early stopping with patience,
and the trained model written back as a `save_pretrained` folder with its tokenizer.

Early stopping follows Lightning's `EarlyStopping(monitor="val_loss", mode="min", min_delta, patience)`: an
evaluation improves when its loss is below the reference by more than `min_delta`, and only then does the
reference move; `patience` evaluations in a row without an improvement stop the run. HF's
`EarlyStoppingCallback` compares with the best loss so far, which moves on every improvement however small,
so a loss creeping down by less than the threshold each time stops the run although it has fallen by far
more in all; Lightning's reference lets those steps add up. Both count evaluations, not steps. A NaN/inf
val loss counts as no improvement (Lightning stops at once; here the patience decides, as for any bad one).
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.errors import CheckpointError, ModelSpecError, OutputError, one_line
from ..data.chat import hf_of, with_template
from ..data.tokenizer import BYTES, HFTokenizer
from ..engine.lora import is_lora, merged_copy
from ..engine.quantization import merge_to_plain, quantized_layers
from ..engine.sharding import unsharded_class
from ..engine.strategies import Strategy
from ..models.loading import source_of


@dataclass
class Selection:
    """The lowest val loss so far (what best.pt holds) and the early-stop count. A checkpoint keeps it, so a
    resumed run stops, and picks its best, exactly where the uninterrupted one would."""

    patience: int | None = None  # None: never stop early (the count is still kept, for the summary)
    min_delta: float = 0.0
    best_loss: float = math.inf
    best_step: int | None = None
    reference: float = math.inf  # early stopping's best: moves only on an improvement by more than min_delta
    reference_step: int | None = None
    bad_evals: int = 0  # evaluations since the reference last moved

    def update(self, step: int, val_loss: float) -> None:
        """Record one evaluation; `best_step == step` afterwards when it is the lowest val loss so far."""
        if val_loss < self.reference - self.min_delta:
            self.reference, self.reference_step, self.bad_evals = val_loss, step, 0
        else:
            self.bad_evals += 1
        if val_loss < self.best_loss:
            self.best_loss, self.best_step = val_loss, step

    @property
    def stop(self) -> bool:
        return self.patience is not None and self.bad_evals >= self.patience

    def reason(self) -> str:
        since = f"{self.reference:.4f} (step {self.reference_step})" if self.reference_step is not None else "its start"
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        return (f"val loss did not improve{by} on {since} for {self.bad_evals} evaluations in a row "
                f"(patience {self.patience})")

    def summary(self, step: int, total_steps: int, best_path: Path | None) -> dict:
        """TrainSummary's fields for the best evaluation and an early stop (a run that used all its steps has none)."""
        stopped, best = self.stop and step < total_steps, self.best_step is not None
        return {"best_val_loss": self.best_loss if best else None, "best_step": self.best_step,
                "best_checkpoint": str(best_path) if best and best_path is not None and best_path.is_file() else None,
                "early_stopped_at_step": step if stopped else None,
                "early_stop_reason": self.reason() if stopped else None}

    def adopt(self, later: dict | None, step: int) -> None:
        """Resuming from `step`: a best.pt this run wrote past it (the attempt went on before it died) holds the
        only copy of those weights, so it stays the best until the replayed steps beat it, and the summary
        names what the file holds."""
        if later and (later["best_step"] or 0) > step:
            self.best_loss, self.best_step = later["best_loss"], later["best_step"]

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("patience", "min_delta")}  # those: the config's

    def load_state_dict(self, state: dict | None) -> None:
        for key, value in (state or {}).items():  # a checkpoint from before best.pt existed has none
            setattr(self, key, value)


def restore_best(model, selection: Selection, step: int, best_path: Path, strategy: Strategy) -> str:
    """restore_best at a run's end: the best checkpoint's weights (best.pt, or a sharded strategy's best/ folder)
    into `model` (unless the last step was the best); says which weights the model now holds. Sharded: every rank
    calls it."""
    if selection.best_step is None or selection.best_step == step:
        return f"final weights (step {step}{', also the best' if selection.best_step == step else ''})"
    state = strategy.read(best_path)
    if state["step"] != selection.best_step:  # replaced by another run since: never restore the wrong weights
        raise CheckpointError(f"{best_path} holds step {state['step']}, not this run's best step "
                              f"{selection.best_step}; drop restore_best or use a checkpoint_dir of its own")
    strategy.load(best_path, state, model)
    return f"best weights (step {selection.best_step}, val loss {selection.best_loss:.4f}, from {best_path.name})"


def check_save_hf(model, folder, merge: bool = False) -> None:
    """Before training: `save_hf` needs a transformers model, since only those have a save_pretrained form (a
    LoRA model's is peft's adapter folder; merged, it is its base's)."""
    if merge and not callable(getattr(model.get_base_model(), "save_pretrained", None)):
        raise OutputError(f"merge writes a transformers model and {type(model.get_base_model()).__name__} is not "
                          "one; drop merge: save_hf then writes peft's adapter folder")
    if folder is not None and not callable(getattr(model, "save_pretrained", None)):
        raise OutputError(f"save_hf needs a transformers model (one with save_pretrained); {type(model).__name__} "
                          "is not one: drop save_hf and use the checkpoint (load_model('<checkpoint_dir>/best.pt' or "
                          "'last.pt')), or load its weights into the transformers class and train that")


def _merged(model, stored_dtype):
    """A plain copy of a LoRA model with its adapters folded in; over a 4-bit base (QLoRA) the base dequantised
    first and the copy in the base's stored dtype (peft's merge into a 4-bit layer would write a 4-bit model)."""
    if quantized_layers(model):
        return merge_to_plain(copy.deepcopy(model), stored_dtype)  # the trained model stays as the result holds it
    return merged_copy(model)


def name_classes(model, classes: list[str] | None) -> None:
    """A transformers classifier's id2label and label2id from the data's class names (a folder's subfolders, a
    table's label values), so the saved folder names its classes; kept as they are where the head's size differs."""
    config = getattr(getattr(model, "get_base_model", lambda: model)(), "config", None)
    if classes and config is not None and getattr(config, "num_labels", None) == len(classes):
        config.id2label = dict(enumerate(classes))
        config.label2id = {name: i for i, name in enumerate(classes)}


def describe_new_head(model, classes: list[str] | None) -> str | None:
    """The head the loader started new (a pretrained classifier fine-tuned on the data's classes), in words; None:
    the model's head is its checkpoint's."""
    source = source_of(model)
    if source is None or not source.new_modules:
        return None
    named = f" for the data's {len(classes)} classes ({', '.join(classes[:6])}{', ...' * (len(classes) > 6)})" \
        if classes else ""
    trained = "trained in full beside LoRA's adapters" if is_lora(model) else "trained"
    return f"{', '.join(source.new_modules)}: new{named}, started at random and {trained}"


def save_hf(model, tokenizer, folder, weights: str, merge: bool = False, state_dict: dict | None = None,
            stored_dtype=None, chat_template: str | None = None) -> str:
    """Write `model` (and its tokenizer, when it has files) as a save_pretrained folder; returns what was written,
    e.g. "final weights (step 60); tokenizer saved". A LoRA model writes peft's adapter folder, or with `merge`
    the base with the adapters folded in (a 4-bit base: dequantised, in `stored_dtype`, the dtype the base was
    stored in). `state_dict`: a sharded model's gathered weights; `chat_template`: the Jinja file the chat rows were
    rendered with, written into the folder with the tokenizer."""
    folder = Path(folder).expanduser()
    if state_dict is not None:  # a sharded model: its gathered weights in an unsharded copy of its class
        model = unsharded_class(model)(model.config)
        model.load_state_dict(state_dict)
    (_merged(model, stored_dtype) if merge else model).save_pretrained(folder)
    if is_lora(model):
        dequantised = f", its 4-bit base dequantised to {str(stored_dtype).removeprefix('torch.')}" \
            if quantized_layers(model) else ""
        weights += f"; merged LoRA model{dequantised}" if merge else "; LoRA adapter (peft format)"
    if tokenizer.name == BYTES:
        said = "tokenizer: bytes, nothing to save (load_model(folder) feeds byte ids)"
    else:
        if chat_template is not None:  # the rows were rendered by a copy carrying it: the model's tokenizer has it not
            tokenizer = HFTokenizer(with_template(hf_of(tokenizer), chat_template), tokenizer.name)
        try:
            tokenizer.save(folder)
            said = f"tokenizer {tokenizer.name} saved"
        except ModelSpecError as exc:
            said = f"tokenizer not saved ({one_line(exc)})"
    return f"{weights}; {said}"
