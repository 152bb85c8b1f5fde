"""The error a node raises when a message or its reply cannot be handled as composed (Flower-free)."""


class CompositionError(RuntimeError):
    """The ClientApp's reply cannot be compressed as it stands (wrong mod order, missing keys), or a
    download names a model copy this node does not hold (a new node sent a payload, another version)."""


__all__ = ["CompositionError"]
