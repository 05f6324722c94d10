"""Models as layer sequences: prefix -> blocks -> head, sharing the user's parameters.

``to_layers`` (layers.py) dispatches to the adapters: ``hf.py`` (Hugging Face causal LMs) and
``sequential.py`` (nn.Sequential, DeepSpeed PipelineModule / LayerSpec lists). ``base.py`` holds
the shared types. ``zero3.py`` turns a model built under DeepSpeed's ``zero.Init`` back into a
plain module, layer by layer, before it is cut (``initialize`` calls it). Nothing here imports
the runtime, the engine or the config.
"""

from rp_engine.model.base import HeadModule, LayerSequence, State, batch_to_dict
from rp_engine.model.layers import to_layers

__all__ = ["to_layers", "LayerSequence", "HeadModule", "State", "batch_to_dict"]
