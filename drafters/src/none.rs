//! `--drafter none`: no drafts, so every step is a plain decoding step. What a server
//! runs when speculation is not wanted, and the baseline a benchmark measures
//! speculation against with everything else equal.

use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::{
    inventory, Agreement, Draft, Drafter, DrafterLoadRequest, DrafterRegistration, TargetModel,
    TokenPicker,
};

/// Proposes nothing, and says so: its agreement with every committed token is none, so
/// `--max-draft auto` stays with plain steps.
#[derive(Default)]
pub struct NoDrafter {
    checked: usize,
}

impl Drafter for NoDrafter {
    fn name(&self) -> &str {
        "none"
    }

    fn begin(&mut self, _: &dyn TargetModel, _: &[u32], _: Option<&Array>) -> Result<()> {
        self.checked = 0;
        Ok(())
    }

    fn propose(
        &mut self,
        _: &dyn TargetModel,
        _last: u32,
        _max_k: usize,
        _: &mut dyn TokenPicker,
    ) -> Result<Draft> {
        Ok(Draft::default())
    }

    fn commit(&mut self, verified: &[u32], _: Option<&Array>) -> Result<()> {
        self.checked += verified.len();
        Ok(())
    }

    fn agreement(&mut self) -> Option<Agreement> {
        Some(Agreement {
            agreed: 0,
            checked: std::mem::take(&mut self.checked),
        })
    }

    fn drafts(&self) -> bool {
        false
    }

    fn fork(&self) -> Option<Box<dyn Drafter>> {
        Some(Box::new(NoDrafter::default()))
    }

    fn forks(&self) -> bool {
        true
    }
}

fn load(_: &DrafterLoadRequest) -> Result<Box<dyn Drafter>> {
    Ok(Box::new(NoDrafter::default()))
}

inventory::submit! {
    DrafterRegistration {
        kind: "none",
        summary: "no drafts: plain decoding (a server without speculation, or the baseline to measure one against)",
        detect: |_| false,
        by_name: true,
        load,
    }
}
