"""Multimodal checkpoints whose text decoder batonlm serves natively (text in, text out): which
causal LM runs it and where its tensors are (`ModelConfig.text_decoder_of`; the weight loader
renames them and skips the other modalities')."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDecoderOf:
    """A multimodal checkpoint whose text decoder batonlm serves natively, text in, text out:
    the causal LM that runs it, where its tensors are in the checkpoint (prefix renames, either
    transformers' layout), and the other modalities' tensors, which are not read."""

    causal_lm: str
    renames: tuple[tuple[str, str], ...]
    ignored: tuple[str, ...]

    def decoder_name(self, name: str) -> str | None:
        """The text decoder's name for a checkpoint tensor; None: another modality's."""
        if name.startswith(self.ignored):
            return None
        for theirs, ours in self.renames:
            if name.startswith(theirs):
                return ours + name[len(theirs):]
        return name


MULTIMODAL_TEXT_DECODERS = {
    # Gemma 3 4B, 12B, 27B: a SigLIP vision tower beside Gemma 3's text decoder.
    "Gemma3ForConditionalGeneration": TextDecoderOf(
        "Gemma3ForCausalLM",
        renames=(("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head.")),
        ignored=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
    ),
}
