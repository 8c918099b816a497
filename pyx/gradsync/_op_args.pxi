# The op, wire-format and Adasum-mode arguments of the collectives, parsed
# once for every call that takes them (included by _core.pyx).

# Op names and codes from the C table (gs_op_name); gradsync.ops builds Op on it.
# (interned: a dict lookup of the literal "sum" is then an identity test)
OPS = {sys.intern(gs_op_name(<gs_op_t>code).decode()): code for code in range(GS_NUM_OPS)}
_OP_CODES = dict(OPS)
_OP_CODES.update({v: v for v in OPS.values()})


cdef gs_op_t parse_op(op) except *:
    code = _OP_CODES.get(op)
    if code is None:
        if isinstance(op, str):
            code = _OP_CODES.get(op.lower())
        if code is None:
            raise ArgumentError(f"op must be one of {', '.join(OPS)} (or gradsync.Op), "
                                f"got {op!r}", GS_ERR_INVALID_ARGUMENT)
    return <gs_op_t><int>code


# Wire formats by name (gs_allreduce_wire; docs/GUIDE.md, "Low-precision
# wire formats").
WIRES = ("bfloat16", "float16", "float8_e4m3", "float8_e5m2")
_WIRE_CODES = {"bfloat16": GS_WIRE_BFLOAT16, "float16": GS_WIRE_FLOAT16,
               "float8_e4m3": GS_WIRE_FLOAT8_E4M3, "float8_e5m2": GS_WIRE_FLOAT8_E5M2}


cdef gs_wire_t parse_wire(wire) except *:
    code = _WIRE_CODES.get(wire) if isinstance(wire, str) else None
    if code is None:
        raise ArgumentError(f"wire must be one of {', '.join(WIRES)} or None, got {wire!r}",
                            GS_ERR_INVALID_ARGUMENT)
    return <gs_wire_t><int>code


cdef gs_wire_t wire_of(wire, residual) except *:
    """The call's wire format (GS_WIRE_NONE for None); a residual needs one."""
    if wire is not None:
        return parse_wire(wire)
    if residual is not None:
        raise ArgumentError("residual (error feedback) needs a wire format: pass wire=",
                            GS_ERR_INVALID_ARGUMENT)
    return GS_WIRE_NONE


cdef TensorList residual_arguments(residual, TensorList tin, str call):
    """The residual arrays, one per tensor of tin (None: no error feedback)."""
    if residual is None:
        return None
    cdef TensorList tres = arguments(residual, "residual", True, call, None, tin)
    if tres.n != tin.n:
        raise ArgumentError(f"residual has {tres.n} arrays for {tin.n} tensors",
                            GS_ERR_INVALID_ARGUMENT)
    return tres


cdef gs_op_t adasum_mode(gs_op_t op, object mode) except *:
    """op="adasum" with adasum="flat" or "hierarchical" (docs/GUIDE.md, "Adasum")."""
    if mode is None or mode == "flat":
        return op
    if mode != "hierarchical":
        raise ArgumentError(f"adasum must be 'flat' or 'hierarchical', got {mode!r}",
                            GS_ERR_INVALID_ARGUMENT)
    return GS_OP_ADASUM_HIERARCHICAL if op == GS_OP_ADASUM else op
