//! Writes a tiny random model directory (llama layout, byte-level tokenizer, ChatML):
//! `write_tiny_model OUT_DIR [CONFIG_OVERRIDES_JSON]`.

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or_else(|| {
        anyhow::anyhow!("usage: write_tiny_model OUT_DIR [CONFIG_OVERRIDES_JSON]")
    })?;
    let overrides = args.next().unwrap_or_else(|| "{}".into());
    dspec_engine::tiny_model::write_tiny_model(std::path::Path::new(&dir), &overrides, 0)?;
    println!("wrote a tiny random model to {dir}");
    Ok(())
}
