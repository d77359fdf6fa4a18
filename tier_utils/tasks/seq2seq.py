"""Sequence to sequence: an encoder-decoder (T5, BART, Marian, a hand-written `nn.Transformer`) reading a source
and scored on each target token under teacher forcing."""
from __future__ import annotations

import warnings

import torch

from ..data.chat_reading import chat_rows, instruction_pairs
from ..data.collate import PaddingTally
from ..data.datasets import DataRequest, DataSplits, corpus_name, corpus_split, corpus_topics
from ..data.pairs import Pairs, pair_rows, paired_tensors
from ..data.userdata import PAIRS
from .base import Task, register_task

# The bundled demo's transduction: a snippet of the corpus, and the same snippet in capitals. A tiny encoder-decoder
# learns it in seconds on a CPU (each target token reads one source token through cross-attention), with no download.
DEMO_SNIPPETS_PER_TOPIC = 24
# The names transformers' encoder-decoders and torch's nn.Transformer give their cross-attention modules.
CROSS_ATTENTION = ("EncDecAttention", "encoder_attn", "multihead_attn", "crossattention", "cross_attn")


class Seq2Seq(Task):
    """(B, T_target, vocab) logits: each target position scored on its token, the decoder reading the targets
    shifted right (teacher forcing) and the source through cross-attention."""

    name = "seq2seq"
    aliases = ("text2text", "encoder-decoder")
    auto_class = "AutoModelForSeq2SeqLM"
    peft_task_type = "SEQ_2_SEQ_LM"
    data_hint = ("empty: the bundled snippets and their capitals; or a table of source and target pairs "
                 "(.csv/.jsonl/.parquet; or a translation column), hf-dataset:NAME")
    per_token = True
    feeds_targets = True  # the targets make the decoder's inputs
    binds_model = True
    generates = True
    decodes_targets = True
    export_inputs = ("input_ids", "attention_mask", "decoder_input_ids")
    prediction = "target token"
    reading = PAIRS

    def recognizes(self, architecture: str, config=None, params: frozenset = frozenset()) -> bool:
        """A transformers encoder-decoder (its config says so), or a module whose forward takes decoder inputs."""
        return bool(getattr(config, "is_encoder_decoder", False)) or "decoder_input_ids" in params

    source_call = 0  # one table for both sides (tiny-seq2seq): the encoder embeds the source first

    def source_embedding(self, adapter):
        """The encoder's token embedding (T5 and BART keep one module per side, tied to the shared table)."""
        encoder = getattr(adapter.model, "get_encoder", None)
        embedding = encoder().get_input_embeddings() if callable(encoder) else None
        return embedding if isinstance(embedding, torch.nn.Embedding) else adapter.embeddings()

    def last_prediction(self, batch: dict, mask: torch.Tensor) -> torch.Tensor:
        """The last scored target position (targets start at 0; -100 past their end)."""
        return self.scored(batch["labels"]).long().sum(1).clamp_min(1) - 1

    def attention_role(self, layer: str) -> tuple[str, str, bool]:
        """By the layer's name, as transformers and nn.Transformer name them: cross-attention (T5's EncDecAttention,
        BART's encoder_attn, nn.Transformer's multihead_attn) reads the source for each target position; the
        decoder's self-attention is causal over the targets; the rest is the encoder's, over the source."""
        if any(key in layer for key in CROSS_ATTENTION):
            return "target", "source", False
        if "decoder" in layer:
            return "target", "target", True
        return "source", "source", False

    def attention_kind(self, layer: str) -> str:
        queries, keys, _ = self.attention_role(layer)
        return "cross" if queries != keys else "decoder self" if queries == "target" else "encoder self"

    def positions(self, batch: dict) -> tuple[int, int, int]:
        """Both sides: the source's positions and mask, and the targets' positions and scored places."""
        computed, real, rows = super().positions(batch)
        labels = batch["labels"]
        return computed + labels.numel(), real + int(self.scored(labels).sum()), rows

    def padding_tally(self, seq_len: int, target_len: int | None = None) -> PaddingTally:
        target = target_len or seq_len
        return PaddingTally(seq_len + target, f"seq_len {seq_len}, target_len {target}")

    def target_mask(self, batch: dict) -> torch.Tensor:
        return self.scored(batch["labels"])

    def target_tokens(self, adapter, batch: dict) -> torch.Tensor:
        """What the decoder reads: the targets shifted right by the model's own rule (its start token first), so a
        decoder position is labelled with the token it holds, not the one it predicts."""
        return decoder_inputs(adapter.model, batch["labels"])

    def model_inputs(self, adapter, input_ids: torch.Tensor, labels: torch.Tensor | None) -> dict:
        """Teacher forcing: the decoder reads the targets shifted right by the model's own rule. Without targets (a
        probe of the source side alone), the source is its own target, so every length check sees T_target = T."""
        target = labels if labels is not None else input_ids
        return {"decoder_input_ids": decoder_inputs(adapter.model, target)}

    def datasets(self, data, request: DataRequest) -> DataSplits:
        """Prompt-completion and Alpaca rows as pairs (instruction + input as the source); other pairs as before."""
        rows = chat_rows(data, request)
        return instruction_pairs(rows, request) if rows is not None else super().datasets(data, request)

    def demo(self, request: DataRequest) -> DataSplits:
        train_topics, val_topics = corpus_split()

        def part(topics):
            corpus, sources = corpus_topics(), []
            for topic in topics:
                words = corpus[topic].split()
                step = max(1, len(words) // DEMO_SNIPPETS_PER_TOPIC)
                sources += [" ".join(words[i:i + 6]) for i in range(0, len(words) - 6, step)]
            with warnings.catch_warnings():  # cut to the lengths asked by design (said in its name): no red lines
                warnings.filterwarnings("ignore", message=".* were cut to it")
                return Pairs.encode(sources, [s.upper() for s in sources], request)

        return DataSplits(part(train_topics), part(val_topics), "corpus",
                          f"{corpus_name()}: snippets and the same in capitals, each cut to the lengths asked",
                          request.tokenizer.name,
                          "whole documentation topics held out (every 5th per topic group), so no text is in both")

    def tensors(self, data, request: DataRequest):
        return paired_tensors(data, request)

    def from_texts(self, texts, request: DataRequest) -> DataSplits:
        return pair_rows(texts, request)


def unsupported_encoder_decoder(config) -> str | None:
    """Why a transformers encoder-decoder can't run as a text-to-text model here (Whisper, VisionEncoderDecoder,
    SpeechEncoderDecoder: their encoder reads audio or pixels), or None: it is one transformers' AutoModelForSeq2SeqLM
    loads, or no encoder-decoder at all."""
    if not getattr(config, "is_encoder_decoder", False):
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as TEXT_TO_TEXT

    kind = getattr(config, "model_type", "")
    if kind in TEXT_TO_TEXT:
        return None
    return (f"{kind or type(config).__name__} is an encoder-decoder whose encoder does not read text, which tier_utils "
            "does not support yet; text-to-text encoder-decoders (T5, BART, Marian, ...) and decoder-only LMs run")


def decoder_inputs(model, target: torch.Tensor) -> torch.Tensor:
    """The decoder's inputs for `target` ids (-100 where a target is not scored): the model's own shift where it has
    one (transformers' encoder-decoders start with their decoder_start_token_id), else its declared start token (its
    pad id, 0 if none: T5's rule) followed by the targets, with unscored places as padding."""
    config = getattr(model, "config", None)
    start = next((v for v in (getattr(model, "decoder_start_token_id", None),
                              getattr(config, "decoder_start_token_id", None)) if isinstance(v, int)), None)
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare) and start is not None:  # a config built in Python may name no start token: then ours
        return prepare(labels=target)
    pad = next((v for v in (getattr(model, "pad_token_id", None), getattr(config, "pad_token_id", None))
                if isinstance(v, int)), 0)
    start = pad if start is None else start
    shifted = torch.full_like(target, pad)
    shifted[:, 0] = start
    shifted[:, 1:] = target[:, :-1].masked_fill(target[:, :-1] == -100, pad)
    return shifted


SEQ2SEQ = register_task(Seq2Seq())
