"""What a node computes in the reference app: data partitions (``data``, ``datafiles``,
``text_data``), models (``models``, ``lm``), LoRA adapters (``lora``), the training objective and
loop (``objective``, ``training``).

fedcomp's library (``compression``, ``client``, ``strategies``, ``secagg``) never needs this package:
a user's own Flower app brings its own task.
"""
