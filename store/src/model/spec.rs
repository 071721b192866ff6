//! A tensor's spec and how it is placed across ranks ([`TensorSpec`], [`Placement`]: stage,
//! tensor-parallel dimension, ZeRO group), as saved in manifests; the rules that turn a
//! placement into the boxes each rank holds are [`crate::placement`].

use serde::{Deserialize, Serialize};

use super::DType;

/// The pipeline stage a tensor belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "at")]
pub enum Stage {
    /// The first stage (embeddings).
    First,
    /// The last stage (final norm, output projection).
    Last,
    /// The stage holding transformer layer `index` of `of`.
    Layer {
        /// Layer index.
        index: u32,
        /// Number of layers.
        of: u32,
    },
}

/// A ZeRO flat group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ZeroGroup {
    /// Group name: tensors of one group are flattened together (e.g. `exp_avg`).
    pub group: String,
    /// The ZeRO stage from which the group is partitioned (1 for optimizer state, 3 for
    /// parameters).
    pub from_stage: u8,
}

/// How one tensor is placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Registration order (ZeRO flattens groups in this order).
    pub order: u32,
    /// Split across tensor-parallel ranks along this dimension; `None` = replicated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_dim: Option<usize>,
    /// The pipeline stage.
    pub stage: Stage,
    /// The ZeRO group, if the tensor is partitioned by ZeRO.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero: Option<ZeroGroup>,
}

/// A tensor and its placement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Placement.
    pub placement: Placement,
}

impl TensorSpec {
    /// A tensor of the first pipeline stage, neither split by tensor parallelism nor
    /// partitioned by ZeRO, registered first: how a model without model parallelism places
    /// every tensor. [`TensorSpec::with_tp`] and [`TensorSpec::with_order`] change the two
    /// that vary most.
    pub fn first_stage(name: impl Into<String>, dtype: DType, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            placement: Placement {
                order: 0,
                tp_dim: None,
                stage: Stage::First,
                zero: None,
            },
        }
    }

    /// This spec split across tensor-parallel ranks along `dim` (`None`: replicated).
    pub fn with_tp(mut self, dim: Option<usize>) -> TensorSpec {
        self.placement.tp_dim = dim;
        self
    }

    /// This spec registered `order`-th.
    pub fn with_order(mut self, order: u32) -> TensorSpec {
        self.placement.order = order;
        self
    }
}
