//! One module per kernel hook.
pub mod conntrack;
pub mod flock;
pub mod getsockopt;
pub mod ipvs;
pub mod nft_commit;
pub mod nft_mutex;
pub mod nft_send;
pub mod process;
pub mod refusal;
pub mod setsockopt;
pub mod skb_drop;
pub mod xt_replace;
