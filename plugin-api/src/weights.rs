//! Weights by HF tensor name: from a checkpoint directory (single or sharded
//! safetensors, validated before MLX touches them), or made up at random for tests.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use mlx_rs::{random, Array, Dtype};

use crate::error::{ModelError, Result};
use crate::target::{LoadOptions, Quantization};

/// Where an adapter gets its tensors from. Adapters ask by HF name and expected shape;
/// the source checks the shape and casts float tensors to the requested dtype.
pub trait WeightSource {
    /// A float tensor that must exist with exactly `shape`.
    fn tensor(&mut self, name: &str, shape: &[i32]) -> Result<Array>;

    /// Whether `name` exists (optional tensors: biases, untied heads, quantization parts).
    fn contains(&self, name: &str) -> bool;

    /// A tensor taken as stored, without shape check or cast (quantized weight parts).
    fn raw(&mut self, name: &str) -> Result<Array>;

    fn options(&self) -> &LoadOptions;

    /// The LoRA update for linear layer `module` (`model.layers.0.self_attn.q_proj`,
    /// weight `[out_dim, in_dim]`) when this source carries an adapter that targets it.
    /// Plain checkpoints carry none; dspec-adapters' LoRA loading wraps a source to add one.
    fn lora_update(
        &mut self,
        _module: &str,
        _in_dim: i32,
        _out_dim: i32,
    ) -> Result<Option<LoraUpdate>> {
        Ok(None)
    }
}

/// A low-rank update of one linear layer: `y = x Wᵀ + scale · (x Aᵀ) Bᵀ`.
pub struct LoraUpdate {
    /// `[rank, in_dim]`.
    pub a: Array,
    /// `[out_dim, rank]`.
    pub b: Array,
    pub scale: f32,
    /// `Some`: keep the update beside the weight and apply it while the switch is on
    /// (one switch shared by every layer of an adapter); `None`: merge it into the
    /// weight at load (`W + scale · B A`), for speed, with no way back.
    pub switch: Option<Arc<AtomicBool>>,
}

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

/// Made-up weights for tests: any tensor asked for is created (seeded, deterministic),
/// and everything handed out is recorded so it can be saved as a real checkpoint.
pub struct RandomWeights {
    options: LoadOptions,
    seed: u64,
    counter: u64,
    pub created: BTreeMap<String, Array>,
}

impl RandomWeights {
    pub fn new(seed: u64) -> Result<Self> {
        Ok(Self {
            options: LoadOptions::default(),
            seed,
            counter: 0,
            created: BTreeMap::new(),
        })
    }

    /// Writes everything created so far as `model.safetensors` in `dir`. With
    /// `quantize`, every 2-D `.weight` (linear and embedding layers) whose input
    /// width allows it is stored MLX-quantized (`weight`/`scales`/`biases`).
    pub fn save(&self, dir: &Path, quantize: Option<Quantization>) -> Result<()> {
        let mut out: Vec<(String, Array)> = Vec::new();
        for (name, array) in &self.created {
            let quantizable = name.ends_with(".weight")
                && array.ndim() == 2
                && quantize.is_some_and(|q| array.shape()[1] % q.group_size == 0);
            match quantize.filter(|_| quantizable) {
                Some(q) => {
                    let (w, scales, biases) = mlx_rs::ops::quantize(array, q.group_size, q.bits)?;
                    let stem = name.trim_end_matches(".weight");
                    out.push((name.clone(), w));
                    out.push((format!("{stem}.scales"), scales));
                    out.push((format!("{stem}.biases"), biases));
                }
                None => out.push((name.clone(), array.clone())),
            }
        }
        let path = dir.join("model.safetensors");
        Array::save_safetensors(out.iter().map(|(n, a)| (n.as_str(), a)), None, &path).map_err(
            |e| ModelError::MlxIo {
                path,
                message: e.to_string(),
            },
        )
    }
}

impl WeightSource for RandomWeights {
    fn tensor(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        if let Some(existing) = self.created.get(name) {
            return Ok(existing.clone());
        }
        self.counter += 1;
        // One key per tensor, in creation order: the same model code gives the same weights.
        let key = random::key(
            self.seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .wrapping_add(self.counter),
        )?;
        let noise = random::normal::<f32>(shape, None, None, Some(&key))?;
        // Norm weights near their neutral value keep activations in a sane range;
        // other weights get the usual small init.
        let is_norm = name.contains("norm") && shape.len() == 1;
        let array = if is_norm {
            noise
                .multiply(Array::from_f32(0.1))?
                .add(Array::from_f32(1.0))?
        } else {
            let fan_in = *shape.last().unwrap_or(&1) as f32;
            noise.multiply(Array::from_f32(1.0 / fan_in.sqrt()))?
        };
        array.eval()?;
        self.created.insert(name.to_string(), array.clone());
        Ok(array)
    }

    fn contains(&self, name: &str) -> bool {
        self.created.contains_key(name)
    }

    fn raw(&mut self, name: &str) -> Result<Array> {
        self.created.get(name).cloned().ok_or_else(|| {
            ModelError::Unsupported(format!("random weights have no raw tensor `{name}`"))
        })
    }

    fn options(&self) -> &LoadOptions {
        &self.options
    }
}
