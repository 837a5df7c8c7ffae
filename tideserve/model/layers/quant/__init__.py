"""Weight quantization (``--quantization``): ``int8`` runs every linear layer (and the LM head) as int8
GEMMs; ``int4`` keeps weights in 4-bit blocks (the LM head in 8-bit blocks) for the native kernels;
``gguf`` keeps a GGUF file's own blocks.

One module per job, each importing only the ones above it in this list, so a linear layer needs nothing
but the weight formats:

- ``blocks``: GGUF block formats, quantizing float weights into them and back.
- ``weights``: the quantized weight matrices a linear layer calls (``Int8Weight``, ``QuantWeight``) and a
  checkpoint tensor kept in its blocks (``QuantTensor``).
- ``methods``: which methods are applied while loading, and why one cannot run on a device.
- ``transform``: ``quantize_model``, a quantized copy of a loaded float model.
- ``weight_bytes``: the bytes a model's weights occupy, quantized ones included.
- ``calibration``: SmoothQuant's activation ranges, from one float forward pass.

Trade-offs, measured in docs/benchmarks.md: greedy tokens agree with the float model for most of a
generation and perplexity rises slightly. Whether a row's result depends on its batch-mates is stated by
each weight format (``Int8Weight``, ``QuantWeight``).
"""
