"""Build DSAFlowConfig objects in tests without Hydra: `make_cfg(**{"model.num_layers": 8, "layout": "FSSS"})`."""

from dsaflow.config.schema import DSAFlowConfig, GraphBlockConfig


def make_cfg(**dotted):
    cfg = DSAFlowConfig()
    for key, value in dotted.items():
        target, parts = cfg, key.split(".")
        for part in parts[:-1]:
            target = getattr(target, part)
        if not hasattr(target, parts[-1]):
            raise KeyError(key)
        setattr(target, parts[-1], value)
    return cfg


def block(name, kind, layers=None, shape_classes=(1, 2, 4)):
    return GraphBlockConfig(
        name=name, kind=kind, layers=list(layers) if layers else None, shape_classes=list(shape_classes)
    )
