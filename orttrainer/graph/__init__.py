"""From the forward+loss ONNX graph to the training and eval graphs: rewrites of ops without a usable
gradient, the gradient build, gradients given for ops kept whole, CPU kernel swaps, recompute, and the ONNX
file save_as_onnx writes."""
