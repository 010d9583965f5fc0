// flashlite's host helpers in C++, each for a step that runs on every replayed call:
//  - plan_key: the plan key of an attention() call, the same information as flashlite._attention.plans.signature
//    (shapes, strides, dtypes and devices of the tensors; the other arguments with their classes), packed into
//    one bytes object. Python builds that tuple from about twenty attribute reads, each allocating (torch.Size,
//    stride tuples, torch.device), and hashes it: 1.5 us per call on the development CPU. Here the sizes are read
//    off the tensors without allocating, and the bytes hash and compare with memcmp.
//  - any_length_key: the key of the same call without its key length (flashlite.attn.plan.any_length_key), for
//    plans that serve every key length (a decoding loop, whose key length grows by one per call).
//  - replay: the key, the plan's lookup and the plan's call in one C call; on a miss, the same with the key
//    without the key length.
//  - launch_recorded: a recorded Triton launch replayed with new tensors, their addresses read and checked here.
//  - fields_key: the key flashlite.attn.plan.key_of builds for the other entries (attention_with_kvcache,
//    attention_varlen, the flat launchers), packed the same way: a decoding step with a KV cache keys eight tensors
//    and five options per call, about 4 us in Python on the development CPU.
//
// plan_key returns None for any argument it does not cover (a tensor subclass, a non-strided or symbolic tensor, a
// scale that is not a float, ...): the caller then builds the Python key, so a call is never keyed by less than it
// needs. Two calls get equal bytes only if every packed field is equal; a field's tag says which class it had.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace {

// The packed key: on the stack while it fits (every call without many-dimensional tensors or long strings), so a
// call allocates nothing but the bytes object it returns.
class Key {
 public:
  // Inlined into each put: a field of constant size is then one store, not a call.
  inline __attribute__((always_inline)) void append(const char* bytes, std::size_t count) {
    if (!spilled_ && size_ + count <= sizeof(inline_)) {
      std::memcpy(inline_ + size_, bytes, count);
      size_ += count;
    } else {
      spill(bytes, count);
    }
  }
  const char* data() const { return spilled_ ? heap_.data() : inline_; }
  Py_ssize_t size() const { return static_cast<Py_ssize_t>(size_); }

 private:
  void spill(const char* bytes, std::size_t count) {
    if (!spilled_) heap_.assign(inline_, size_), spilled_ = true;
    heap_.append(bytes, count);
    size_ += count;
  }
  char inline_[512];
  std::size_t size_ = 0;
  bool spilled_ = false;
  std::string heap_;
};

template <typename T>
inline __attribute__((always_inline)) void put(Key& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Tags: which class an argument had. Distinct per argument slot is not needed (slots are positional).
enum Tag : std::uint8_t { kNone = 0, kTensor = 1, kTrue = 2, kFalse = 3, kStr = 4, kFloat = 5, kIntPair = 6,
                          kAnyLength = 7, kFields = 8, kInt = 9, kTuple = 10 };

// Writes the tag of None and says so; any other object is left to the caller.
bool put_none(Key& out, PyObject* obj) {
  if (obj != Py_None) return false;
  put<std::uint8_t>(out, kNone);
  return true;
}

// What every tensor's key starts with: tag, dtype, device type and index, number of dims.
void put_tensor_header(Key& out, const at::Tensor& t) {
  put<std::uint8_t>(out, kTensor);
  put<std::int16_t>(out, static_cast<std::int16_t>(t.scalar_type()));
  put<std::int16_t>(out, static_cast<std::int16_t>(t.device().type()));
  put<std::int16_t>(out, static_cast<std::int16_t>(t.device().index()));
  put<std::int64_t>(out, t.dim());
}

bool put_tensor(Key& out, PyObject* obj, bool optional) {
  if (optional && put_none(out, obj)) return true;
  // Exactly torch.Tensor (or Parameter): a subclass may override what shape or stride means.
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() ||
      t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return false;
  }
  const std::int64_t dim = t.dim();
  put_tensor_header(out, t);
  out.append(reinterpret_cast<const char*>(t.sizes().data()), dim * sizeof(std::int64_t));
  out.append(reinterpret_cast<const char*>(t.strides().data()), dim * sizeof(std::int64_t));
  return true;
}

bool put_str(Key& out, PyObject* obj) {
  if (!PyUnicode_CheckExact(obj)) return false;
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(obj, &size);
  if (text == nullptr) {  // not encodable (lone surrogates): leave it to the Python key
    PyErr_Clear();
    return false;
  }
  put<std::uint8_t>(out, kStr);
  put<std::int64_t>(out, size);
  out.append(text, size);
  return true;
}

bool put_optional_str(Key& out, PyObject* obj) { return put_none(out, obj) || put_str(out, obj); }

bool put_optional_float(Key& out, PyObject* obj) {
  if (put_none(out, obj)) return true;
  if (!PyFloat_CheckExact(obj)) return false;
  put<std::uint8_t>(out, kFloat);
  put<double>(out, PyFloat_AS_DOUBLE(obj));  // bit pattern: 0.0 and -0.0 differ, which only costs a second plan
  return true;
}

bool put_causal(Key& out, PyObject* obj) {
  if (obj == Py_True) {
    put<std::uint8_t>(out, kTrue);
    return true;
  }
  if (obj == Py_False) {
    put<std::uint8_t>(out, kFalse);
    return true;
  }
  return put_str(out, obj);
}

bool put_window(Key& out, PyObject* obj) {
  if (put_none(out, obj)) return true;
  if (!PyTuple_CheckExact(obj) || PyTuple_GET_SIZE(obj) != 2) return false;
  put<std::uint8_t>(out, kIntPair);
  for (Py_ssize_t i = 0; i < 2; ++i) {
    PyObject* side = PyTuple_GET_ITEM(obj, i);
    if (!PyLong_CheckExact(side)) return false;  // bool included: it is a subclass of int
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(side, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    put<long long>(out, value);
  }
  return true;
}

// Packs the plan key of the twelve arguments at args into out; false where the Python key is needed.
bool pack_key(Key& out, PyObject* const* args) {
  try {
    return put_tensor(out, args[0], false) && put_tensor(out, args[1], false) && put_tensor(out, args[2], false) &&
           put_tensor(out, args[3], true) && put_tensor(out, args[4], true) && put_causal(out, args[5]) &&
           put_optional_float(out, args[6]) && put_str(out, args[7]) && put_optional_str(out, args[8]) &&
           put_window(out, args[9]) && put_optional_float(out, args[10]) && put_tensor(out, args[11], true);
  } catch (...) {  // a tensor whose sizes cannot be read without Python: the Python key decides
    return false;
  }
}

// A 4-d tensor without its key axis: tag, dtype, device, the sizes but dim ``skip``, no strides (a key axis grown by
// torch.cat changes them). Reads the skipped size into ``skipped``.
bool put_tensor_without(Key& out, PyObject* obj, int skip, std::int64_t& skipped) {
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() ||
      t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || t.dim() <= skip) {
    return false;
  }
  const std::int64_t dim = t.dim();
  put_tensor_header(out, t);
  const auto sizes = t.sizes();
  for (std::int64_t i = 0; i < dim; ++i) {
    if (i != skip) put<std::int64_t>(out, sizes[i]);
  }
  skipped = sizes[skip];
  return true;
}

// The dispatch table's sequence bucket (flashlite._intmath.seq_bucket): a power of two, at least 64.
std::int64_t seq_bucket(std::int64_t n) {
  std::int64_t bucket = 64;
  while (bucket < n) bucket <<= 1;
  return bucket;
}

// Packs the key of the twelve arguments without the key length into out (flashlite.attn.plan.any_length_key's
// fields): q whole; k and v without S_k and their strides; key_padding_mask without S_k and its strides; the
// bucket of max(S_q, S_k), which the dispatch table keys on. False where the Python key is needed: a tensor that
// is not 4-d, an empty key axis, k and v of other key lengths, or what pack_key leaves to Python.
bool pack_any_length_key(Key& out, PyObject* const* args) {
  try {
    put<std::uint8_t>(out, kAnyLength);
    std::int64_t seq_k = 0, seq_v = 0, seq_mask = 0;
    if (!put_tensor(out, args[0], false) || !put_tensor_without(out, args[1], 2, seq_k) ||
        !put_tensor_without(out, args[2], 2, seq_v) || seq_k < 1 || seq_v != seq_k) {
      return false;
    }
    const at::Tensor& q = THPVariable_Unpack(args[0]);
    if (q.dim() != 4 || THPVariable_Unpack(args[1]).dim() != 4) return false;
    if (!put_none(out, args[3])) {
      if (!put_tensor_without(out, args[3], 1, seq_mask) || seq_mask != seq_k) return false;
    }
    put<std::int64_t>(out, seq_bucket(std::max<std::int64_t>(q.size(2), seq_k)));
    return put_tensor(out, args[4], true) && put_causal(out, args[5]) && put_optional_float(out, args[6]) &&
           put_str(out, args[7]) && put_optional_str(out, args[8]) && put_window(out, args[9]) &&
           put_optional_float(out, args[10]) && put_tensor(out, args[11], true);
  } catch (...) {
    return false;
  }
}

// The key ``pack`` makes of a call's twelve arguments as bytes, or None where the Python key is needed.
PyObject* packed_or_none(bool (*pack)(Key&, PyObject* const*), const char* name, PyObject* const* args,
                         Py_ssize_t nargs) {
  if (nargs != 12) {
    PyErr_Format(PyExc_TypeError, "%s takes 12 positional arguments", name);
    return nullptr;
  }
  Key out;
  if (!pack(out, args)) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(out.data(), out.size());
}

// plan_key(q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap,
//          alibi_slopes) -> bytes, or None where the Python key is needed.
PyObject* plan_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return packed_or_none(pack_key, "plan_key", args, nargs);
}

// any_length_key(the same twelve arguments) -> bytes, or None where the Python key is needed.
PyObject* any_length_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return packed_or_none(pack_any_length_key, "any_length_key", args, nargs);
}

// One field of fields_key: None, an exact tensor (its layout), True/False, an exact str, float or int, or a tuple of
// such fields (its length, then each field); false for anything else (a subclass, a torch.Size, a dtype object),
// which the Python key then covers. Every field starts with its class's tag, so 1, 1.0 and True never pack alike,
// as in the Python key, and a tuple's items keep their classes: (True, 0) differs from (1, 0).
bool put_field(Key& out, PyObject* obj, int depth) {
  if (put_none(out, obj)) return true;
  if (obj == Py_True || obj == Py_False) {
    put<std::uint8_t>(out, obj == Py_True ? kTrue : kFalse);
    return true;
  }
  if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    put<std::uint8_t>(out, kInt);
    put<long long>(out, value);
    return true;
  }
  if (PyFloat_CheckExact(obj)) {
    put<std::uint8_t>(out, kFloat);
    put<double>(out, PyFloat_AS_DOUBLE(obj));
    return true;
  }
  if (PyUnicode_CheckExact(obj)) return put_str(out, obj);
  if (PyTuple_CheckExact(obj)) {
    if (depth > 4) return false;  // keys nest a tuple or two; deeper ones are left to Python
    const Py_ssize_t count = PyTuple_GET_SIZE(obj);
    put<std::uint8_t>(out, kTuple);
    put<std::int64_t>(out, count);
    for (Py_ssize_t i = 0; i < count; ++i) {
      if (!put_field(out, PyTuple_GET_ITEM(obj, i), depth + 1)) return false;
    }
    return true;
  }
  return put_tensor(out, obj, false);
}

// fields_key(entry, *fields) -> bytes of the entry and every field (flashlite.attn.plan.key_of's information), or
// None where a field needs the Python key. The kFields tag first: never equal to a packed attention key, whose
// first byte is q's tensor tag or kAnyLength; the entry next, so keys of two entries never equal either.
PyObject* fields_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || !PyUnicode_CheckExact(args[0])) {
    PyErr_SetString(PyExc_TypeError, "fields_key takes an entry name (str) and the fields");
    return nullptr;
  }
  Key out;
  put<std::uint8_t>(out, kFields);
  try {
    if (!put_str(out, args[0])) Py_RETURN_NONE;
    for (Py_ssize_t i = 1; i < nargs; ++i) {
      if (!put_field(out, args[i], 0)) Py_RETURN_NONE;
    }
  } catch (...) {  // a tensor whose sizes cannot be read without Python: the Python key decides
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(out.data(), out.size());
}

// The plan kept in plans under the packed key, borrowed; nullptr with no error set where there is none.
PyObject* find(PyObject* plans, const Key& packed) {
  PyObject* key = PyBytes_FromStringAndSize(packed.data(), packed.size());
  if (key == nullptr) return nullptr;
  PyObject* plan = PyDict_GetItemWithError(plans, key);  // borrowed
  Py_DECREF(key);
  return plan;
}

// replay(plans, fallback, q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window,
//        softcap, alibi_slopes): the output of the plan kept in the dict plans for this call's key, else for its key
// without the key length, computed by plan.run(q, k, v[, key_mask[, alibi_slopes]]) (key_mask: key_lengths if
// given, else key_padding_mask); None when plans holds neither. Where the key needs Python, fallback(plans, q, ...,
// alibi_slopes) answers instead.
// One C call for what attention() does on every replayed call: the key, the lookup and the plan's call.
PyObject* replay(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 14 || !PyDict_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "replay takes a dict, a callable and 12 more positional arguments");
    return nullptr;
  }
  PyObject* const* call = args + 2;
  Key out;
  if (!pack_key(out, call)) {
    // The fallback takes plans and the twelve arguments: args[0] and args[2:], shifted by one slot.
    PyObject* fallback_args[13];
    fallback_args[0] = args[0];
    for (int i = 0; i < 12; ++i) fallback_args[i + 1] = call[i];
    return PyObject_Vectorcall(args[1], fallback_args, 13, nullptr);
  }
  PyObject* plan = find(args[0], out);
  if (plan == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    // No plan of this exact call: one that serves every key length may answer it (kept only for such plans).
    Key any_length;
    if (!pack_any_length_key(any_length, call)) Py_RETURN_NONE;
    plan = find(args[0], any_length);
    if (plan == nullptr) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
  }
  static PyObject* run_name = PyUnicode_InternFromString("run");
  // Held while its run is read: a plan class with Python attribute hooks could drop the dict's reference meanwhile.
  Py_INCREF(plan);
  PyObject* run = PyObject_GetAttr(plan, run_name);
  Py_DECREF(plan);
  if (run == nullptr) return nullptr;
  // run(q, k, v[, key_mask[, alibi_slopes]]): the trailing Nones are left off (SDPA, a plan's run, parses each
  // argument it is given).
  PyObject* key_mask = call[4] != Py_None ? call[4] : call[3];
  PyObject* run_args[5] = {call[0], call[1], call[2], key_mask, call[11]};
  const Py_ssize_t count = call[11] != Py_None ? 5 : key_mask != Py_None ? 4 : 3;
  PyObject* result = PyObject_Vectorcall(run, run_args, count, nullptr);
  Py_DECREF(run);
  return result;
}

// launch_recorded(run, grid, stream, function, metadata, tensors, device_index, rest): a recorded Triton launch
// replayed with new tensors (flashlite._direct_launch.RecordedLaunch.launch), as
// run(*grid, stream, function, metadata, None, None, None, *addresses, *rest). True when it launched; False, having
// launched nothing, when a tensor's address is not 16-byte aligned or it is on another device than device_index
// (-1: the CPU); None for anything else than exact torch.Tensors with storage, which the Python loop then checks.
// A tensor given again (the launchers repeat q in unused slots) is read once.
PyObject* launch_recorded(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8 || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[5]) || !PyTuple_CheckExact(args[7])) {
    PyErr_SetString(PyExc_TypeError,
                    "launch_recorded takes run, a grid tuple, stream, function, metadata, a tuple of tensors, a "
                    "device index and a tuple of the other arguments");
    return nullptr;
  }
  const long device_index = PyLong_AsLong(args[6]);
  if (device_index == -1 && PyErr_Occurred()) return nullptr;
  PyObject* grid = args[1];
  PyObject* tensors = args[5];
  PyObject* rest = args[7];
  const Py_ssize_t n_grid = PyTuple_GET_SIZE(grid), n_tensors = PyTuple_GET_SIZE(tensors);
  const Py_ssize_t n_rest = PyTuple_GET_SIZE(rest);
  std::vector<std::uintptr_t> addresses(static_cast<std::size_t>(n_tensors));
  try {
    for (Py_ssize_t i = 0; i < n_tensors; ++i) {
      PyObject* obj = PyTuple_GET_ITEM(tensors, i);
      Py_ssize_t seen = -1;
      for (Py_ssize_t j = 0; j < i && seen < 0; ++j) {
        if (PyTuple_GET_ITEM(tensors, j) == obj) seen = j;
      }
      if (seen >= 0) {
        addresses[i] = addresses[seen];
        continue;
      }
      if (!THPVariable_CheckExact(obj)) Py_RETURN_NONE;
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (!t.defined() || !t.has_storage()) Py_RETURN_NONE;
      const auto address = reinterpret_cast<std::uintptr_t>(t.data_ptr());
      const long device = t.is_cpu() ? -1 : static_cast<long>(t.get_device());
      if (address % 16 != 0 || device != device_index) Py_RETURN_FALSE;
      addresses[i] = address;
    }
  } catch (...) {  // a tensor whose address cannot be read this way: the Python loop decides
    Py_RETURN_NONE;
  }
  std::vector<PyObject*> call;
  call.reserve(static_cast<std::size_t>(n_grid + 7 + n_tensors + n_rest));
  for (Py_ssize_t i = 0; i < n_grid; ++i) call.push_back(PyTuple_GET_ITEM(grid, i));
  for (int i = 2; i <= 4; ++i) call.push_back(args[i]);  // stream, function, metadata
  for (int i = 0; i < 3; ++i) call.push_back(Py_None);  // the launch metadata and the two launch hooks
  const std::size_t first_address = call.size();
  for (Py_ssize_t i = 0; i < n_tensors; ++i) {
    PyObject* address = PyLong_FromUnsignedLongLong(addresses[static_cast<std::size_t>(i)]);
    if (address == nullptr) {
      for (std::size_t j = first_address; j < call.size(); ++j) Py_DECREF(call[j]);
      return nullptr;
    }
    call.push_back(address);
  }
  const std::size_t end_of_addresses = call.size();
  for (Py_ssize_t i = 0; i < n_rest; ++i) call.push_back(PyTuple_GET_ITEM(rest, i));
  PyObject* result = PyObject_Vectorcall(args[0], call.data(), call.size(), nullptr);
  for (std::size_t j = first_address; j < end_of_addresses; ++j) Py_DECREF(call[j]);
  if (result == nullptr) return nullptr;
  Py_DECREF(result);
  Py_RETURN_TRUE;
}

PyMethodDef methods[] = {
    {"plan_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plan_key)), METH_FASTCALL,
     "plan_key(q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap, "
     "alibi_slopes) -> bytes or None"},
    {"any_length_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(any_length_key)), METH_FASTCALL,
     "any_length_key(q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap, "
     "alibi_slopes) -> bytes or None"},
    {"replay", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(replay)), METH_FASTCALL,
     "replay(plans, fallback, q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, "
     "softcap, alibi_slopes) -> the kept plan's output, or None"},
    {"fields_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fields_key)), METH_FASTCALL,
     "fields_key(entry, *fields) -> bytes or None"},
    {"launch_recorded", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(launch_recorded)), METH_FASTCALL,
     "launch_recorded(run, grid, stream, function, metadata, tensors, device_index, rest) -> True, False or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "flashlite_plan_key", "attention()'s plan key, packed in C++.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit_flashlite_plan_key() { return PyModule_Create(&module); }
