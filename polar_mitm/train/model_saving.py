"""What a training leaves: the model the next training continues from, and the checkpoint an engine loads.

The two differ. The next training continues from the weights in the training dtype (or from the LoRA adapter);
an engine needs a full Hugging Face checkpoint with any LoRA merged in, in the narrower of the training dtype and
the run's initial checkpoint's (`sync.write_dtype`: a bf16 model stays bf16 even when trained in fp32, in every
training of a loop — each saved config.json records that dtype, `sync.record_source_dtype`), with
polar-mitm's model metadata beside it (`polar_model.json`). `ModelSavingMixin.save_final` writes the first (plus `merged/` when asked, and the
optimizer's state with `run_state_dir`), `save_for_engine` the second (what the weight push sends, train/sync.py).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

from accelerate.utils import is_peft_model

from polar_mitm.storage.tokenizer_files import keep_added_tokens_in_config, save_tokenizer
from polar_mitm.train.sync import record_source_dtype, set_checkpoint_dtype, write_dtype

MODEL_METADATA_FILES = ("polar_model.json",)  # tells `polar-mitm serve` which parsers the model family uses


class ModelSavingMixin:
    """`PolarGRPOTrainer`'s saving (`model_source`, the checkpoint directory it started from, is set at init)."""

    model_source: Path | None

    def save_for_engine(self, output_dir: str | Path) -> Path:
        """Write a full Hugging Face checkpoint an engine can load: the weights (LoRA merged in) in `write_dtype` —
        a bf16 model stays bf16 even when trained in fp32 — the tokenizer, and the model metadata polar-mitm's
        engine reads."""
        output_dir = Path(output_dir)
        main = self.accelerator.is_main_process
        model = self.accelerator.unwrap_model(self.model)
        dtype = write_dtype(model.dtype, self.model_source)
        if self.is_peft:
            if main:
                merged = copy.deepcopy(model).merge_and_unload().to(dtype)
                merged.save_pretrained(output_dir)
                save_tokenizer(self.processing_class, output_dir)
            self.accelerator.wait_for_everyone()
        elif dtype == model.dtype:
            self.save_model(str(output_dir))
        else:
            weights = self.accelerator.get_state_dict(self.model)  # collective under ZeRO-3 / FSDP
            if main:
                self._save(str(output_dir), state_dict={k: v.to(dtype) for k, v in weights.items()})
            self.accelerator.wait_for_everyone()
        if main:
            set_checkpoint_dtype(output_dir, dtype)
            record_source_dtype(output_dir, self.model_source)
            self._copy_model_metadata(output_dir)
        return output_dir

    def save_final(self) -> dict[str, Path]:
        """Save the trained model to output_dir (full weights in the training dtype — the copy a next training
        continues from — or LoRA adapters plus `merged/` when asked); with `run_state_dir`, the optimizer too."""
        output_dir = Path(self.args.output_dir)
        self.save_model(str(output_dir))
        saved = {"model": output_dir}
        if self.accelerator.is_main_process:
            record_source_dtype(
                output_dir, self.model_source
            )  # a training started from it writes in that dtype
            self._copy_model_metadata(output_dir)
        if self.is_peft and self.args.save_merged:
            saved["merged"] = self.save_for_engine(output_dir / "merged")
        if self.args.run_state_dir:
            saved["run_state"] = self.save_run_state()
        return saved

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """transformers' save (every `save_model`), with the tokenizer's added tokens kept in its config: the engine,
        the gateway and the next training each load it in half the time (storage/tokenizer_files.py)."""
        super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save and self.processing_class is not None:
            keep_added_tokens_in_config(output_dir or self.args.output_dir, self.processing_class)

    @property
    def is_peft(self) -> bool:
        return is_peft_model(self.accelerator.unwrap_model(self.model))

    def _copy_model_metadata(self, output_dir: Path) -> None:
        if self.model_source is None:
            return
        for name in MODEL_METADATA_FILES:
            src = self.model_source / name
            if src.exists() and not (output_dir / name).exists():
                shutil.copy2(src, output_dir / name)
