"""How a rank keeps its optimizer when memory binds: :mod:`.offload` steps it in host memory
(the executor's folder holds its limit of modules; ZeRO stage 1's shards are ``zero.py``)."""
