//! A checkpoint directory's weights by HF tensor name (one or sharded safetensors files,
//! each header validated before MLX touches the data), and the same with progress
//! reported as tensors are taken, which is how every built-in family loads.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{LoadOptions, LoadRequest, WeightSource};

fn is_float(dtype: Dtype) -> bool {
    matches!(
        dtype,
        Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float64
    )
}

/// A tensor's entry in a safetensors header.
#[derive(Debug, Clone)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<i64>,
}

/// Reads and checks a safetensors header without loading data: every tensor's byte
/// range must lie inside the file and match its dtype and shape. MLX loads lazily and
/// would otherwise fail (or read garbage) only when a truncated tensor is first used.
fn read_header(path: &Path) -> Result<BTreeMap<String, HeaderEntry>> {
    let corrupt = |reason: String| ModelError::CorruptWeights {
        path: path.to_path_buf(),
        reason,
    };
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut len_bytes = [0u8; 8];
    file.read_exact(&mut len_bytes)
        .map_err(|_| corrupt("shorter than its 8-byte header length".into()))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > 100 * 1024 * 1024 || 8 + header_len > file_len {
        return Err(corrupt(format!(
            "header length {header_len} does not fit in a {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let parsed: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| corrupt(format!("header is not JSON: {e}")))?;
    let data_len = file_len - 8 - header_len;
    let mut entries = BTreeMap::new();
    for (name, info) in parsed {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info["dtype"].as_str().unwrap_or_default().to_string();
        let shape: Vec<i64> = info["shape"]
            .as_array()
            .map(|dims| dims.iter().filter_map(|d| d.as_i64()).collect())
            .ok_or_else(|| corrupt(format!("tensor `{name}` has no shape")))?;
        let offsets: Vec<u64> = info["data_offsets"]
            .as_array()
            .map(|o| o.iter().filter_map(|d| d.as_u64()).collect())
            .unwrap_or_default();
        let [start, end] = offsets[..] else {
            return Err(corrupt(format!("tensor `{name}` has no data_offsets")));
        };
        if end < start || end > data_len {
            return Err(corrupt(format!(
                "tensor `{name}` ends at byte {end} but the file holds {data_len} data bytes (truncated?)"
            )));
        }
        let elem_bits: u64 = match dtype.as_str() {
            "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 8,
            "U16" | "I16" | "F16" | "BF16" => 16,
            "U32" | "I32" | "F32" => 32,
            "U64" | "I64" | "F64" => 64,
            _ => 0,
        };
        let numel: u64 = shape.iter().map(|&d| d.max(0) as u64).product();
        if elem_bits > 0 && numel * elem_bits / 8 != end - start {
            return Err(corrupt(format!(
                "tensor `{name}` ({dtype}, shape {shape:?}) should take {} bytes but has {}",
                numel * elem_bits / 8,
                end - start
            )));
        }
        entries.insert(name, HeaderEntry { dtype, shape });
    }
    Ok(entries)
}

/// The safetensors files of a checkpoint dir: `model.safetensors.index.json`'s shards
/// when present, else every `*.safetensors` file.
fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
            path: index.clone(),
            source,
        })?;
        let parsed: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::config(&index, format!("invalid JSON: {e}")))?;
        let map = parsed["weight_map"]
            .as_object()
            .ok_or_else(|| ModelError::config(&index, "has no `weight_map` object"))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        for f in &files {
            if !f.is_file() {
                return Err(ModelError::config(
                    &index,
                    format!("lists shard {} which does not exist", f.display()),
                ));
            }
        }
        return Ok(files);
    }
    let listing = std::fs::read_dir(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = listing
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::config(
            dir,
            "no *.safetensors weights found; point --target at a model directory (GGUF files must be converted first with `dspec convert`)",
        ));
    }
    Ok(files)
}

/// Loads every tensor of one safetensors file into `tensors` (later files win on a
/// name clash), after checking its header.
fn load_file(file: &Path, tensors: &mut HashMap<String, (PathBuf, Array)>) -> Result<()> {
    let header = read_header(file)?;
    let arrays = Array::load_safetensors(file).map_err(|e| ModelError::MlxIo {
        path: file.to_path_buf(),
        message: e.to_string(),
    })?;
    for (name, array) in arrays {
        if let Some(entry) = header.get(&name) {
            let stored: Vec<i64> = array.shape().iter().map(|&d| d as i64).collect();
            if stored != entry.shape {
                return Err(ModelError::CorruptWeights {
                    path: file.to_path_buf(),
                    reason: format!(
                        "tensor `{name}` ({}) read back with a different shape",
                        entry.dtype
                    ),
                });
            }
        }
        tensors.insert(name, (file.to_path_buf(), array));
    }
    Ok(())
}

/// Weights of a checkpoint directory, loaded lazily by MLX.
pub struct Weights {
    dir: PathBuf,
    options: LoadOptions,
    /// name -> (file, array)
    tensors: HashMap<String, (PathBuf, Array)>,
    taken: usize,
    total: usize,
}

impl Weights {
    pub fn open(dir: &Path, options: &LoadOptions) -> Result<Self> {
        let mut tensors = HashMap::new();
        for file in checkpoint_files(dir)? {
            load_file(&file, &mut tensors)?;
        }
        Ok(Self::from_tensors(dir, options, tensors))
    }

    /// One safetensors file on its own, e.g. an adapter file in a directory that also
    /// holds training checkpoints, which [`Weights::open`] would mix in.
    pub fn open_file(path: &Path, options: &LoadOptions) -> Result<Self> {
        let mut tensors = HashMap::new();
        load_file(path, &mut tensors)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Ok(Self::from_tensors(dir, options, tensors))
    }

    fn from_tensors(
        dir: &Path,
        options: &LoadOptions,
        tensors: HashMap<String, (PathBuf, Array)>,
    ) -> Self {
        let total = tensors.len();
        Self {
            dir: dir.to_path_buf(),
            options: options.clone(),
            tensors,
            taken: 0,
            total,
        }
    }

    /// Tensors handed out so far (for progress reports).
    pub fn taken(&self) -> usize {
        self.taken
    }

    /// Tensors in the checkpoint.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Names nobody asked for (after loading: tensors the model does not use).
    pub fn unused(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort();
        names
    }

    fn take(&mut self, name: &str, expected: &[i32]) -> Result<(PathBuf, Array)> {
        let found = self
            .tensors
            .remove(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
                expected: expected.to_vec(),
            })?;
        self.taken += 1;
        Ok(found)
    }
}

impl WeightSource for Weights {
    fn tensor(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let (file, array) = self.take(name, shape)?;
        if array.shape() != shape {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                file,
                expected: shape.to_vec(),
                actual: array.shape().to_vec(),
            });
        }
        if !is_float(array.dtype()) {
            return Err(ModelError::UnsupportedDtype {
                name: name.to_string(),
                file,
                dtype: format!("{:?}", array.dtype()),
                wanted: "a float tensor".into(),
            });
        }
        match self.options.dtype {
            Some(dtype) if dtype != array.dtype() => Ok(array.as_dtype(dtype)?),
            _ => Ok(array),
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn raw(&mut self, name: &str) -> Result<Array> {
        Ok(self.take(name, &[])?.1)
    }

    fn options(&self) -> &LoadOptions {
        &self.options
    }
}

/// Forwards to [`Weights`] and reports progress as tensors are taken.
pub(crate) struct ProgressWeights<'a> {
    inner: Weights,
    progress: &'a dyn Fn(usize, usize),
}

impl<'a> ProgressWeights<'a> {
    /// The checkpoint of `req`, reporting to its progress callback.
    pub(crate) fn open(req: &LoadRequest<'a>) -> Result<Self> {
        Ok(Self {
            inner: Weights::open(req.dir, req.options)?,
            progress: req.progress,
        })
    }
}

impl WeightSource for ProgressWeights<'_> {
    fn tensor(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        let t = self.inner.tensor(name, shape)?;
        // MLX reads lazily; evaluating here makes progress reflect the real I/O and
        // frees the checkpoint-dtype copy as soon as a cast tensor exists.
        t.eval()?;
        (self.progress)(self.inner.taken(), self.inner.total());
        Ok(t)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn raw(&mut self, name: &str) -> Result<Array> {
        let t = self.inner.raw(name)?;
        t.eval()?;
        (self.progress)(self.inner.taken(), self.inner.total());
        Ok(t)
    }

    fn options(&self) -> &LoadOptions {
        self.inner.options()
    }
}
