use anyhow::Result;

use super::{manifest::PodRun, Node};

pub fn run(_node: &Node, _pod: &PodRun) -> Result<()> {
    Ok(())
}
