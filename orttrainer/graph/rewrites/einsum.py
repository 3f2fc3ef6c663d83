"""Einsum with one or two operands as ReduceSum, Transpose, Reshape and a batched MatMul (or Mul without a
summed index), ops whose gradients ONNX Runtime has; its own module because the index bookkeeping is its own.
"""

import numpy as np

from ._building import RewriteError, node_output


def _einsum_terms(build):
    """(each operand's indices, the output's, the equation) of the Einsum being replaced; an ellipsis becomes
    letters of its own for the axes it stands for (right-aligned, as einsum broadcasts them), which needs each
    operand's rank."""
    equation = build.attribute("equation").replace(" ", "")
    if "->" not in equation:
        raise RewriteError(f"Einsum node '{build.node.name}': equation '{equation}' needs an explicit '->'")
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if "..." in equation:
        ranks = [len(build.shape(name)) for name in build.node.input]
        spans = [rank - (len(term) - 3) if "..." in term else 0 for term, rank in zip(terms, ranks)]
        unused = [letter for letter in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if letter not in equation][: max(spans)]
        terms = [term.replace("...", "".join(unused[len(unused) - span :]) if span else "") for term, span in zip(terms, spans)]
        output = output.replace("...", "".join(unused))
    if any(len(set(term)) != len(term) for term in terms):
        raise RewriteError(f"Einsum node '{build.node.name}': repeated indices in '{equation}' (diagonals) are not supported")
    return terms, output, equation


def _sum_out(build, x, term, keep):
    """Sum over the indices of ``term`` not in ``keep``; return (tensor, remaining indices)."""
    axes = [index for index, letter in enumerate(term) if letter not in keep]
    if not axes:
        return x, term
    return build.reduce("ReduceSum", x, axes, 0), "".join(letter for letter in term if letter in keep)


def _transpose(build, x, term, order, output=None):
    if term == order:
        return build.op("Identity", [x], output) if output else x
    return build.op("Transpose", [x], output, perm=[term.index(letter) for letter in order])


def _aligned(build, x, term, output):
    """x with its indices in output order and size-1 axes where it lacks an output index."""
    present = "".join(letter for letter in output if letter in term)
    x = _transpose(build, x, term, present)
    missing = [position for position, letter in enumerate(output) if letter not in term]
    return build.unsqueeze(x, missing) if missing else x


def _broadcast_product(build, a, term_a, b, term_b, output):
    """Einsum without a summed index: an elementwise product after aligning both operands."""
    build.op("Mul", [_aligned(build, a, term_a, output), _aligned(build, b, term_b, output)], node_output(build))


def _merged_axes(build, x, shape, start, groups):
    """x reshaped so that, from axis ``start`` on, each of ``groups`` consecutive axes (counts; 0 for none) becomes
    one axis of their sizes' product (1 for none); ``shape`` is x's Shape."""
    sizes, at = [_shape_slice(build, shape, 0, start)], start
    for count in groups:
        sizes.append(build.reduce("ReduceProd", _shape_slice(build, shape, at, at + count), [0], 1) if count
                     else build.const([1], np.int64))  # fmt: skip
        at += count
    return build.op("Reshape", [x, build.op("Concat", sizes, axis=0)])


def _shape_slice(build, shape, start, end):
    return build.op("Slice", [shape, build.const([start], np.int64), build.const([end], np.int64)])


def einsum(build):
    """Einsum with one or two operands as ReduceSum/Transpose/MatMul (or Mul without a summed index): the
    indices of each side lined up as (shared, own free, summed), each group reshaped into one axis, a batched
    MatMul, and the free axes reshaped back."""
    terms, output, equation = _einsum_terms(build)
    if len(terms) == 1:
        x, term = _sum_out(build, build.node.input[0], terms[0], output)
        _transpose(build, x, term, output, node_output(build))
        return
    if len(terms) != 2:
        raise RewriteError(f"Einsum node '{build.node.name}': '{equation}' has {len(terms)} operands (1 or 2 supported)")
    (a, term_a), (b, term_b) = (
        _sum_out(build, name, term, set(output) | set(other))
        for name, term, other in ((build.node.input[0], terms[0], terms[1]), (build.node.input[1], terms[1], terms[0]))
    )
    contracted = [letter for letter in term_a if letter in term_b and letter not in output]
    if not contracted:
        _broadcast_product(build, a, term_a, b, term_b, output)
        return
    batch = [letter for letter in output if letter in term_a and letter in term_b]
    left = [letter for letter in output if letter in term_a and letter not in term_b]
    right = [letter for letter in output if letter in term_b and letter not in term_a]
    a = _transpose(build, a, term_a, "".join(batch + left + contracted))
    b = _transpose(build, b, term_b, "".join(batch + contracted + right))
    a_shape, b_shape = build.op("Shape", [a]), build.op("Shape", [b])
    start = len(batch)
    product = build.op("MatMul", [_merged_axes(build, a, a_shape, start, [len(left), len(contracted)]),
                                  _merged_axes(build, b, b_shape, start, [len(contracted), len(right)])])  # fmt: skip
    sizes = [_shape_slice(build, build.op("Shape", [product]), 0, start),  # shared axes as MatMul broadcast them
             _shape_slice(build, a_shape, start, start + len(left)),
             _shape_slice(build, b_shape, start + len(contracted), start + len(contracted) + len(right))]  # fmt: skip
    product = build.op("Reshape", [product, build.op("Concat", sizes, axis=0)])
    _transpose(build, product, "".join(batch + left + right), output, node_output(build))
