"""What TensorBoard shows beyond scalars: translations as text, attention maps as images."""

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.loggers import TensorBoardLogger
from torch import Tensor

from ..data import TranslationDataModule
from ..model import EncoderDecoder, MultiHeadAttention
from .scoring import Score

# Dark blue to yellow (viridis at five stops): low attention dark, high attention bright.
_COLORS = torch.tensor([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]]) / 255


@torch.no_grad()
def attention_maps(model: EncoderDecoder, src: Tensor, tgt_in: Tensor) -> dict[str, Tensor]:
    """Per-head attention weights of one teacher-forced pass over a single pair, src (1, S) and tgt_in (1, T):
    {"decoder_self/layer{i}": (nh, T, T), "cross/layer{i}": (nh, T, S)}. Hooks ask the attention modules
    for their weights, so the model itself keeps no state."""
    maps, handles = {}, []

    def ask_for_weights(module, args, kwargs):
        return args, {**kwargs, "need_weights": True, "average_attn_weights": False}

    def keep(name):
        return lambda module, args, output: maps.__setitem__(name, output[1][0].float())

    for i, layer in enumerate(model.decoder.layers):
        for name, attn in (("decoder_self", layer.self_attn), ("cross", layer.cross_attn)):
            assert isinstance(attn, MultiHeadAttention)
            handles.append(attn.register_forward_pre_hook(ask_for_weights, with_kwargs=True))
            handles.append(attn.register_forward_hook(keep(f"{name}/layer{i}")))
    try:
        with torch.compiler.set_stance("force_eager"):  # were forward compiled, its graphs would run no hooks
            model(src, tgt_in)
    finally:
        for handle in handles:
            handle.remove()
    return maps


def heatmap(weights: Tensor, scale: int = 8) -> Tensor:
    """(nh, T, S) weights in [0, 1] -> (3, T*scale, nh*(S*scale+2)) RGB image: heads side by side."""
    weights = weights / weights.amax().clamp(min=1e-9)  # brightest cell at full scale
    position = weights.clamp(0, 1) * (len(_COLORS) - 1)
    low = position.floor().long().clamp(max=len(_COLORS) - 2)
    rgb = torch.lerp(_COLORS[low], _COLORS[low + 1], (position - low).unsqueeze(-1))  # (nh, T, S, 3)
    rgb = rgb.repeat_interleave(scale, 1).repeat_interleave(scale, 2)  # (nh, T*scale, S*scale, 3)
    rgb = torch.nn.functional.pad(rgb, (0, 0, 0, 2), value=1.0)  # a white gap after each head
    return rgb.permute(3, 1, 0, 2).flatten(2)  # (3, T*scale, nh*(S*scale+2))


class TensorBoardSamples(Callback):
    """After each scored validation: a few source/reference/hypothesis triples as text; after each
    validation: attention maps of one fixed validation sentence, to watch alignment form."""

    def __init__(self, sentence: int = 0, scale: int = 8):
        self.sentence, self.scale = sentence, scale
        self._shown: Score | None = None

    def on_validation_end(self, trainer: Trainer, module: LightningModule) -> None:
        loggers = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if trainer.sanity_checking or not loggers or not trainer.is_global_zero:
            return
        writers, step = [logger.experiment for logger in loggers], trainer.global_step
        score = getattr(module, "last_score", None)
        if score is not None and score.examples and score is not self._shown:  # a validation that scored BLEU
            self._shown = score
            rows = [f"**source:** {s}  \n**reference:** {r}  \n**hypothesis:** {h}" for s, r, h in score.examples]
            text = "\n\n---\n\n".join(rows) + f"\n\n`{score.signature}`"
            for writer in writers:
                writer.add_text("val/translations", text, step)
        for name, image in self._attention_images(trainer, module).items():
            for writer in writers:
                writer.add_image(f"attention/{name}", image, step)

    def _attention_images(self, trainer: Trainer, module: LightningModule) -> dict[str, Tensor]:
        data = trainer.datamodule
        if not isinstance(data, TranslationDataModule) or self.sentence >= len(data.validation_split):
            return {}
        example, tok = data.validation_split[self.sentence], data.tgt_tokenizer
        src = torch.tensor([list(example["src_ids"]) + [tok.eos_id]], device=module.device)
        tgt_in = torch.tensor([[tok.bos_id] + list(example["tgt_ids"])], device=module.device)
        training = module.training
        module.eval()
        try:  # in the run's precision, as validation: a GPU's flash kernel takes no float32
            with trainer.precision_plugin.forward_context():
                maps = attention_maps(module.model, src, tgt_in)
        finally:
            module.train(training)
        return {name: heatmap(weights.cpu(), self.scale) for name, weights in maps.items()}
