"""What runs the graphs: the build from a first batch to a Runtime, the graph per batch signature, ONNX
Runtime sessions bound to torch memory, and the torch kernels a split graph runs between ONNX Runtime
segments (convolutions, recurrent layers, CTC loss, small ops); the GPU provider's libraries."""
