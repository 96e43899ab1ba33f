//! DLPack in both directions, without libtorch: `Exported` hands a Rust-owned buffer to Python as
//! an object with `__dlpack__` (so `torch.from_dlpack` and `numpy.from_dlpack` wrap it without a
//! copy), and `read_dlpack` reads a CPU tensor's bytes out of a producer's capsule.
//!
//! The structs follow `dlpack.h` (version 1.0): the legacy `DLManagedTensor` (capsule name
//! `dltensor`) and `DLManagedTensorVersioned` (`dltensor_versioned`), given to a consumer that asks
//! with `max_version >= (1, 0)`.

use std::any::Any;
use std::ffi::{c_void, CStr};
use std::sync::Mutex;

use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

const DL_CPU: i32 = 1;
/// Page-locked host memory (CUDA): readable from the CPU like `DL_CPU`.
const DL_CUDA_HOST: i32 = 3;

const CAPSULE_LEGACY: &CStr = c"dltensor";
const CAPSULE_VERSIONED: &CStr = c"dltensor_versioned";
const CAPSULE_USED_LEGACY: &CStr = c"used_dltensor";

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// Element types crossing the boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElemType {
    U8,
    I16,
    I32,
    I64,
    F32,
    BF16,
    F16,
    F64,
    Bool,
}

impl ElemType {
    fn dl(self) -> DLDataType {
        let (code, bits) = match self {
            ElemType::U8 => (1, 8),
            ElemType::I16 => (0, 16),
            ElemType::I32 => (0, 32),
            ElemType::I64 => (0, 64),
            ElemType::F32 => (2, 32),
            ElemType::F16 => (2, 16),
            ElemType::F64 => (2, 64),
            ElemType::BF16 => (4, 16),
            ElemType::Bool => (6, 8),
        };
        DLDataType { code, bits, lanes: 1 }
    }

    fn from_dl(dtype: DLDataType) -> Option<ElemType> {
        [
            ElemType::U8,
            ElemType::I16,
            ElemType::I32,
            ElemType::I64,
            ElemType::F32,
            ElemType::F16,
            ElemType::F64,
            ElemType::BF16,
            ElemType::Bool,
        ]
        .into_iter()
        .find(|t| t.dl() == dtype)
    }

    pub fn size(self) -> usize {
        match self {
            ElemType::U8 | ElemType::Bool => 1,
            ElemType::I16 | ElemType::BF16 | ElemType::F16 => 2,
            ElemType::I32 | ElemType::F32 => 4,
            ElemType::I64 | ElemType::F64 => 8,
        }
    }

    /// The name torch gives the type, for error messages and stubs.
    pub fn name(self) -> &'static str {
        match self {
            ElemType::U8 => "uint8",
            ElemType::I16 => "int16",
            ElemType::I32 => "int32",
            ElemType::I64 => "int64",
            ElemType::F32 => "float32",
            ElemType::F16 => "float16",
            ElemType::F64 => "float64",
            ElemType::BF16 => "bfloat16",
            ElemType::Bool => "bool",
        }
    }
}

/// Whatever keeps an exported buffer's memory alive; dropped by the consumer's deleter, on
/// whichever thread that runs, with or without the GIL, so it must not touch Python.
pub type Owner = Box<dyn Any + Send>;

/// A buffer ready to leave: its first byte, type, shape and owner.
struct Export {
    data: *mut u8,
    elem: ElemType,
    shape: Vec<i64>,
    owner: Owner,
}

// SAFETY: `data` points into memory that `owner` (which is Send) keeps alive and that nothing else
// aliases; moving the pointer with its owner to another thread is moving the owner.
unsafe impl Send for Export {}

/// A Rust-owned buffer as a DLPack producer: one `__dlpack__` call hands it over (a second is an
/// error), and the consumer's deleter frees it. Dropped unexported, it frees the buffer itself.
#[pyclass(module = "stoke._native", frozen)]
pub struct Exported {
    export: Mutex<Option<Export>>,
    elem: ElemType,
    shape: Vec<i64>,
}

impl Exported {
    /// Hands out `buffer`, a `Vec` of any plain element, as a tensor of `shape`.
    pub fn from_vec<T: Send + 'static>(mut buffer: Vec<T>, elem: ElemType, shape: Vec<i64>) -> Exported {
        debug_assert_eq!(std::mem::size_of::<T>() * buffer.len(), shape.iter().product::<i64>() as usize * elem.size());
        let data = buffer.as_mut_ptr() as *mut u8;
        Exported::from_owner(data, Box::new(buffer), elem, shape)
    }

    /// Hands out the memory at `data`, which `owner` keeps alive.
    pub fn from_owner(data: *mut u8, owner: Owner, elem: ElemType, shape: Vec<i64>) -> Exported {
        let export = Export { data, elem, shape: shape.clone(), owner };
        Exported { export: Mutex::new(Some(export)), elem, shape }
    }
}

#[pymethods]
impl Exported {
    /// A DLPack capsule of the buffer (versioned when `max_version` allows it). The buffer is
    /// handed over: a second call raises.
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<Py<PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let _ = stream; // CPU memory: no stream to order against.
        if dl_device.is_some_and(|(kind, _)| kind != DL_CPU) {
            return Err(PyBufferError::new_err("stoke's buffers live in CPU memory; copy the tensor to the device"));
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err("copy=True is not supported; the export is already zero-copy"));
        }
        let export = self
            .export
            .lock()
            .expect("never poisoned")
            .take()
            .ok_or_else(|| PyBufferError::new_err("this buffer was already exported through DLPack"))?;
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        let capsule = if versioned { versioned_capsule(export) } else { legacy_capsule(export) };
        // SAFETY: a capsule constructor returns a new reference or NULL with an exception set.
        unsafe { Bound::from_owned_ptr_or_err(py, capsule).map(Bound::unbind) }
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (DL_CPU, 0)
    }

    /// The element type's torch name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.elem.name()
    }

    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }
}

/// What a capsule's manager context points to: the managed struct's shape and the owner.
struct Holder<M> {
    managed: M,
    shape: Vec<i64>,
    _owner: Owner,
}

fn dl_tensor(data: *mut u8, elem: ElemType, shape: &mut [i64]) -> DLTensor {
    DLTensor {
        data: data as *mut c_void,
        device: DLDevice { device_type: DL_CPU, device_id: 0 },
        ndim: shape.len() as i32,
        dtype: elem.dl(),
        shape: shape.as_mut_ptr(),
        // NULL strides: compact row-major (DLPack 1.0 asks consumers to accept it; torch does).
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    }
}

fn legacy_capsule(export: Export) -> *mut ffi::PyObject {
    let Export { data, elem, shape, owner } = export;
    let mut holder = Box::new(Holder {
        managed: DLManagedTensor {
            dl_tensor: dl_tensor(data, elem, &mut []),
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_legacy),
        },
        shape,
        _owner: owner,
    });
    // The shape lives in the box, whose heap address does not move from here on.
    holder.managed.dl_tensor = dl_tensor(data, elem, &mut holder.shape);
    let holder = Box::into_raw(holder);
    // SAFETY: `holder` is a live, uniquely owned allocation; the capsule's destructor or the
    // consumer's call of the deleter frees it exactly once (the consumer renames the capsule
    // before it takes ownership, and the destructor only acts on the unrenamed name).
    unsafe {
        (*holder).managed.manager_ctx = holder as *mut c_void;
        let managed = &mut (*holder).managed as *mut DLManagedTensor;
        ffi::PyCapsule_New(managed as *mut c_void, CAPSULE_LEGACY.as_ptr(), Some(capsule_destructor_legacy))
    }
}

fn versioned_capsule(export: Export) -> *mut ffi::PyObject {
    let Export { data, elem, shape, owner } = export;
    let mut holder = Box::new(Holder {
        managed: DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_versioned),
            flags: 0,
            dl_tensor: dl_tensor(data, elem, &mut []),
        },
        shape,
        _owner: owner,
    });
    holder.managed.dl_tensor = dl_tensor(data, elem, &mut holder.shape);
    let holder = Box::into_raw(holder);
    // SAFETY: as in `legacy_capsule`.
    unsafe {
        (*holder).managed.manager_ctx = holder as *mut c_void;
        let managed = &mut (*holder).managed as *mut DLManagedTensorVersioned;
        ffi::PyCapsule_New(managed as *mut c_void, CAPSULE_VERSIONED.as_ptr(), Some(capsule_destructor_versioned))
    }
}

unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    // SAFETY: the deleter is called once, by the consumer or the capsule destructor, on the
    // pointer `legacy_capsule` made; its context is the box it leaked.
    unsafe { drop(Box::from_raw((*managed).manager_ctx as *mut Holder<DLManagedTensor>)) }
}

unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: as in `delete_legacy`.
    unsafe { drop(Box::from_raw((*managed).manager_ctx as *mut Holder<DLManagedTensorVersioned>)) }
}

/// A capsule no consumer took (still under its original name): free the tensor.
unsafe extern "C" fn capsule_destructor_legacy(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the GIL held on a capsule we made; `PyCapsule_IsValid` sets no
    // exception, and a renamed (consumed) capsule is left to its consumer.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_LEGACY.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, CAPSULE_LEGACY.as_ptr()) as *mut DLManagedTensor;
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

unsafe extern "C" fn capsule_destructor_versioned(capsule: *mut ffi::PyObject) {
    // SAFETY: as in `capsule_destructor_legacy`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_VERSIONED.as_ptr()) == 1 {
            let managed =
                ffi::PyCapsule_GetPointer(capsule, CAPSULE_VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
            if let Some(deleter) = (*managed).deleter {
                deleter(managed);
            }
        }
    }
}

/// A CPU tensor read from a producer (anything with `__dlpack__`, e.g. a torch tensor): its type,
/// shape and the address of its bytes, valid while `Borrowed` lives.
pub struct Borrowed {
    pub elem: ElemType,
    pub shape: Vec<usize>,
    data: *const u8,
    len: usize,
    managed: *mut DLManagedTensor,
}

// SAFETY: the producer's memory stays valid until our call of its deleter in `Drop`; reading it
// from another thread while the caller holds the tensor unchanged is what DLPack allows.
unsafe impl Send for Borrowed {}
// SAFETY: shared references only read the bytes (`bytes`); the deleter runs in `Drop`, which needs
// ownership.
unsafe impl Sync for Borrowed {}

impl Borrowed {
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `read_dlpack` checked the tensor is compact and on the CPU; `len` bytes from
        // `data` belong to it until the deleter runs in `Drop`.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        // SAFETY: we own the managed tensor (the capsule was renamed to `used_dltensor` when we
        // took it), so its deleter is ours to call, once. Producers' deleters may need the GIL
        // (torch's takes it itself).
        unsafe {
            if let Some(deleter) = (*self.managed).deleter {
                deleter(self.managed);
            }
        }
    }
}

/// Takes a compact CPU tensor out of `object.__dlpack__()` (legacy capsule). `what` names it in
/// errors (the state_dict key).
pub fn read_dlpack(object: &Bound<'_, PyAny>, what: &str) -> PyResult<Borrowed> {
    let capsule = object
        .call_method0("__dlpack__")
        .map_err(|e| PyTypeError::new_err(format!("{what}: not a tensor with __dlpack__ ({e})")))?;
    // SAFETY: a valid capsule under the legacy name holds a DLManagedTensor (DLPack's contract);
    // renaming it to `used_dltensor` transfers ownership to us, so the capsule's destructor will
    // not free it.
    let managed = unsafe {
        let ptr = ffi::PyCapsule_GetPointer(capsule.as_ptr(), CAPSULE_LEGACY.as_ptr()) as *mut DLManagedTensor;
        if ptr.is_null() {
            return Err(PyErr::fetch(object.py()));
        }
        if ffi::PyCapsule_SetName(capsule.as_ptr(), CAPSULE_USED_LEGACY.as_ptr()) != 0 {
            return Err(PyErr::fetch(object.py()));
        }
        ptr
    };
    // From here on `Borrowed`'s drop calls the deleter, also on the error paths below.
    // SAFETY: `managed` is a valid DLManagedTensor we now own.
    let tensor = unsafe { &(*managed).dl_tensor };
    let mut borrowed = Borrowed { elem: ElemType::U8, shape: Vec::new(), data: std::ptr::null(), len: 0, managed };
    if tensor.device.device_type != DL_CPU && tensor.device.device_type != DL_CUDA_HOST {
        return Err(PyValueError::new_err(format!("{what}: the tensor is not in CPU memory; call .cpu() first")));
    }
    borrowed.elem = ElemType::from_dl(tensor.dtype)
        .ok_or_else(|| PyTypeError::new_err(format!("{what}: unsupported element type {:?}", tensor.dtype)))?;
    let ndim = tensor.ndim.max(0) as usize;
    // SAFETY: DLPack gives `ndim` shape entries and, when not NULL, `ndim` strides.
    let shape: &[i64] = if ndim == 0 { &[] } else { unsafe { std::slice::from_raw_parts(tensor.shape, ndim) } };
    let strides: Option<&[i64]> = if tensor.strides.is_null() || ndim == 0 {
        None
    } else {
        Some(unsafe { std::slice::from_raw_parts(tensor.strides, ndim) })
    };
    if let Some(strides) = strides {
        let mut expected = 1i64;
        for dim in (0..ndim).rev() {
            if shape[dim] != 1 && strides[dim] != expected {
                return Err(PyValueError::new_err(format!(
                    "{what}: the tensor is not contiguous (strides {strides:?} for shape {shape:?}); call .contiguous()"
                )));
            }
            expected *= shape[dim];
        }
    }
    borrowed.shape = shape.iter().map(|&d| d as usize).collect();
    let numel: usize = borrowed.shape.iter().product();
    borrowed.len = numel * borrowed.elem.size();
    // SAFETY: `byte_offset` is within the producer's allocation by DLPack's contract.
    borrowed.data = unsafe { (tensor.data as *const u8).add(tensor.byte_offset as usize) };
    Ok(borrowed)
}
