"""From the user's torch module to the forward+loss ONNX graph: the trace (TorchScript exporter) and its
symbolics, what a forward does that a trace cannot record, the module as the graphs were built from it, and
the first step redone in torch to check the graphs against."""
