"""Checkpoints: a training run's checkpoint folders and the weights in them.

- `store.py`: checkpoint folders in a run dir: manifests, verification, pruning, pinning, pickle-free DCP metadata;
- `training_state.py`: save and load a training rank's model, optimiser and RNG state (DCP, plus weights-only
  safetensors files);
- `resume.py`: whether `train.resume=true` can continue a run dir;
- `weights.py`: load model weights only (serving, search, `train.init_from`) and export them to one file;
- `safetensors_io.py`: the safetensors format, checked against our bounds before the package reads it;
- Hugging Face checkpoints: `hf_folder.py` (what a checkpoint folder may contain), `config_json.py` (the typed
  config.json reader), `hf_config.py` (config.json -> model), `hf_weights.py` (weights in), `hf_export.py` (out);
- `indexer_weights.py`: which layers carry indexer weights, and the plan that follows for serving or resuming."""
