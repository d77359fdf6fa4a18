"""The language tasks of decoder and encoder models: next-token prediction and sequence classification."""
from __future__ import annotations

from ..core.errors import DataError
from ..data.chat_reading import chat_rows, read_chat
from ..data.datasets import (
    DataRequest,
    DataSplits,
    corpus_snippets,
    corpus_windows,
    labelled_rows,
    labelled_tensors,
    text_windows,
    token_rows,
)
from ..data.packing import text_examples
from ..data.userdata import LABELLED
from .base import Task, register_task


class CausalLM(Task):
    """A decoder LM: (B, T, vocab) logits, each position scored on the next token."""

    name = "causal-lm"
    aliases = ("causal_lm",)
    auto_class = "AutoModelForCausalLM"
    architectures = ("ForCausalLM", "LMHeadModel")
    peft_task_type = "CAUSAL_LM"
    data_hint = "empty: the bundled corpus; or a text file, a folder of .txt, a table, hf-dataset:NAME"
    per_token = True
    predicts_input_positions = True
    causal_attention = True
    padding_side = "left"  # batched generation pads on the left
    feeds_targets = True
    positions_from_mask = True
    has_perplexity = True
    export_inputs = ("input_ids",)
    prediction = "next token"
    data_hint = ("empty: the bundled corpus; or a text file, a folder of .txt, a table, chat or instruction rows "
                 "(messages, prompt-completion, Alpaca .jsonl), hf-dataset:NAME")

    def datasets(self, data, request: DataRequest) -> DataSplits:
        """Chat and instruction rows (messages, ShareGPT, prompt-completion, Alpaca) as one example per row with the
        answer scored (data/chat.py); running text as windows, as before."""
        return read_chat(data, request) or super().datasets(data, request)

    def demo(self, request: DataRequest) -> DataSplits:
        return corpus_windows(request)

    def tensors(self, data, request: DataRequest):
        return token_rows(data, request)

    def from_texts(self, texts, request: DataRequest) -> DataSplits:
        """Running text as windows; a table's separate texts, when packed, as one example per row."""
        return text_examples(texts, request) if request.packing and texts.rows else text_windows(texts, request)


class Classification(Task):
    """An encoder classifier: (B, classes) logits, one label per sequence."""

    name = "classification"
    aliases = ("sequence-classification",)
    auto_class = "AutoModelForSequenceClassification"
    architectures = ("ForSequenceClassification",)
    peft_task_type = "SEQ_CLS"
    head_modules = ("classifier", "score")  # BERT's, DeBERTa's, RoBERTa's; Llama's, GPT-2's
    data_hint = ("empty: the bundled corpus' topics; or a table of text and label (.csv/.jsonl/.parquet), "
                 "hf-dataset:NAME")
    has_classes = True
    takes_new_head = True
    reading = LABELLED

    def datasets(self, data, request: DataRequest) -> DataSplits:
        """Labelled text, as before; chat and instruction rows are refused in one line (they train a causal LM)."""
        rows = chat_rows(data, request)
        if rows is not None:
            raise DataError(f"{rows.name} holds chat or instruction rows, which a classifier cannot read; give a "
                            "causal LM (or, for prompt-completion and Alpaca rows, a seq2seq model), or a table of "
                            "text and labels")
        return super().datasets(data, request)

    def demo(self, request: DataRequest) -> DataSplits:
        return corpus_snippets(request)

    def tensors(self, data, request: DataRequest):
        return labelled_tensors(data, request)

    def from_texts(self, texts, request: DataRequest) -> DataSplits:
        return labelled_rows(texts, request)


CAUSAL_LM = register_task(CausalLM())
CLASSIFICATION = register_task(Classification())
