"""One home for state_dict handling: which tensors are float updates, which travel exactly, how an
update is applied per dtype, and copies that keep every shape (0-d and zero-element included).

Used by the client mod, the legacy client, decoding, aggregation, downstream compression and
checkpoints alike. The rules (stated in docs/how-to/existing-app.md):

- **Float tensors** (fp16, bf16, fp32, fp64 parameters and buffers such as BatchNorm's running
  mean/var) are updates like any other: ``delta = trained - received`` in float32, compressed by
  the codec. Applying an update happens in float32 and the result is cast back to the tensor's
  own dtype; it must be finite *after* that cast (an fp16 update that overflows 65504 is refused).
  The server rounds an fp16/bf16 aggregate with its rounding remainder carried from round to round
  (`cast_carried`), so mean updates below half an ulp still move the model.
- **Integer and bool tensors** (BatchNorm's int64 ``num_batches_tracked``, masks, counters) never
  go through a float codec: clients send their value exactly (`fedcomp.compression.exact`)
  and the server aggregates them by `integer_mean` (weighted mean of the clients' values in
  exact integer arithmetic, rounded half to even with the rounding remainder carried from round to
  round, clamped to the dtype's range) or `bool_majority` (weighted
  majority; a tie keeps the global value). They never enter a float codec's whole-model vector
  nor a clipping norm.
- **bfloat16**: numpy has no bfloat16 and Flower's ``ArrayRecord(state_dict)`` refuses it, so
  `to_record` carries bf16 tensors as raw 16-bit patterns (``stype = BF16_STYPE``) and
  `to_state_dict` restores them; in numpy they are float32 values (exactly representable).

- `arrays`: tensors as Flower ``Array``s and back, every dtype, checked casts.
- `integer_rule`: the integer/bool rule.
- `flat`: `FlatModel`, the flat float vector beside the exact tensors.
- `tied`: tied parameters (one tensor under two names): one travels, both are set.
"""

from fedcomp.statedict.arrays import (
    BF16,
    BF16_STYPE,
    HALF_DTYPES,
    array_to_numpy,
    cast_carried,
    cast_checked,
    copy_array,
    dtype_limit,
    is_float_dtype,
    numpy_dict,
    numpy_to_array,
    numpy_view,
    numpy_views,
    to_record,
    to_state_dict,
)
from fedcomp.statedict.flat import FlatModel, Spec
from fedcomp.statedict.tied import retie, tied_aliases, untie
from fedcomp.statedict.integer_rule import (
    bool_majority,
    exact_cast,
    exact_weight,
    integer_delta,
    integer_mean,
    weighted_add,
)

__all__ = ["BF16", "BF16_STYPE", "HALF_DTYPES", "FlatModel", "Spec", "array_to_numpy", "bool_majority", "cast_carried",
           "cast_checked",
           "copy_array", "dtype_limit", "exact_cast", "exact_weight", "integer_delta", "integer_mean", "is_float_dtype",
           "numpy_dict", "numpy_to_array", "numpy_view", "numpy_views", "retie", "tied_aliases", "to_record",
           "to_state_dict", "untie", "weighted_add"]
