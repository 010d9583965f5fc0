// The plan key of an attention() call, built in C++: the same information as flashlite._attention.plans.signature
// (shapes, strides, dtypes and devices of the tensors; the other arguments with their classes), packed into one
// bytes object. Python builds that tuple from about twenty attribute reads, each allocating (torch.Size, stride
// tuples, torch.device), and hashes it: 1.5 us per call on the development CPU. Here the sizes are read off the
// tensors without allocating, and the bytes hash and compare with memcmp.
//
// Returns None for any argument it does not cover (a tensor subclass, a non-strided or symbolic tensor, a scale
// that is not a float, ...): the caller then builds the Python key, so a call is never keyed by less than it
// needs. Two calls get equal bytes only if every packed field is equal; a field's tag says which class it had.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace {

template <typename T>
void put(std::string& out, T value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

// Tags: which class an argument had. Distinct per argument slot is not needed (slots are positional).
enum Tag : std::uint8_t { kNone = 0, kTensor = 1, kTrue = 2, kFalse = 3, kStr = 4, kFloat = 5, kIntPair = 6 };

// Writes the tag of None and says so; any other object is left to the caller.
bool put_none(std::string& out, PyObject* obj) {
  if (obj != Py_None) return false;
  put<std::uint8_t>(out, kNone);
  return true;
}

bool put_tensor(std::string& out, PyObject* obj, bool optional) {
  if (optional && put_none(out, obj)) return true;
  // Exactly torch.Tensor (or Parameter): a subclass may override what shape or stride means.
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || t.layout() != c10::kStrided || t.is_nested() ||
      t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return false;
  }
  const std::int64_t dim = t.dim();
  put<std::uint8_t>(out, kTensor);
  put<std::int16_t>(out, static_cast<std::int16_t>(t.scalar_type()));
  put<std::int16_t>(out, static_cast<std::int16_t>(t.device().type()));
  put<std::int16_t>(out, static_cast<std::int16_t>(t.device().index()));
  put<std::int64_t>(out, dim);
  out.append(reinterpret_cast<const char*>(t.sizes().data()), dim * sizeof(std::int64_t));
  out.append(reinterpret_cast<const char*>(t.strides().data()), dim * sizeof(std::int64_t));
  return true;
}

bool put_str(std::string& out, PyObject* obj) {
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

bool put_optional_str(std::string& out, PyObject* obj) { return put_none(out, obj) || put_str(out, obj); }

bool put_optional_float(std::string& out, PyObject* obj) {
  if (put_none(out, obj)) return true;
  if (!PyFloat_CheckExact(obj)) return false;
  put<std::uint8_t>(out, kFloat);
  put<double>(out, PyFloat_AS_DOUBLE(obj));  // bit pattern: 0.0 and -0.0 differ, which only costs a second plan
  return true;
}

bool put_causal(std::string& out, PyObject* obj) {
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

bool put_window(std::string& out, PyObject* obj) {
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

// plan_key(q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap,
//          alibi_slopes) -> bytes, or None where the Python key is needed.
PyObject* plan_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 12) {
    PyErr_SetString(PyExc_TypeError, "plan_key takes 12 positional arguments");
    return nullptr;
  }
  std::string out;
  out.reserve(256);
  bool covered = false;
  try {
    covered = put_tensor(out, args[0], false) && put_tensor(out, args[1], false) && put_tensor(out, args[2], false) &&
              put_tensor(out, args[3], true) && put_tensor(out, args[4], true) && put_causal(out, args[5]) &&
              put_optional_float(out, args[6]) && put_str(out, args[7]) && put_optional_str(out, args[8]) &&
              put_window(out, args[9]) && put_optional_float(out, args[10]) && put_tensor(out, args[11], true);
  } catch (...) {  // a tensor whose sizes cannot be read without Python: the Python key decides
    covered = false;
  }
  if (!covered) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(out.data(), static_cast<Py_ssize_t>(out.size()));
}

PyMethodDef methods[] = {
    {"plan_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(plan_key)), METH_FASTCALL,
     "plan_key(q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap, "
     "alibi_slopes) -> bytes or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "flashlite_plan_key", "attention()'s plan key, packed in C++.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit_flashlite_plan_key() { return PyModule_Create(&module); }
