//! The kernel's userspace ABI for nf_tables (`linux/netfilter/nf_tables.h` unless said), by enum.

// Families (`linux/netfilter.h`, the anonymous `NFPROTO_*` enum): `nfgenmsg.nfgen_family`.
pub(crate) const NFPROTO_INET: u8 = 1;
pub(crate) const NFPROTO_IPV4: u8 = 2;
pub(crate) const NFPROTO_ARP: u8 = 3;
pub(crate) const NFPROTO_NETDEV: u8 = 5;
pub(crate) const NFPROTO_BRIDGE: u8 = 7;
pub(crate) const NFPROTO_IPV6: u8 = 10;

// Verdicts: netfilter's (`linux/netfilter.h`, `NF_*`) and `enum nft_verdicts`, one number space.
pub(crate) const NF_DROP: i32 = 0;
pub(crate) const NF_ACCEPT: i32 = 1;
pub(crate) const NF_STOLEN: i32 = 2;
pub(crate) const NF_QUEUE: i32 = 3;
pub(crate) const NF_REPEAT: i32 = 4;
pub(crate) const NFT_CONTINUE: i32 = -1;
pub(crate) const NFT_BREAK: i32 = -2;
pub(crate) const NFT_JUMP: i32 = -3;
pub(crate) const NFT_GOTO: i32 = -4;
pub(crate) const NFT_RETURN: i32 = -5;

// enum nft_registers
pub(crate) const NFT_REG_VERDICT: u32 = 0;
#[cfg(test)]
pub(crate) const NFT_REG_1: u32 = 1;

// enum nft_list_attributes
#[cfg(test)]
pub(crate) const NFTA_LIST_ELEM: u16 = 1;

// enum nft_hook_attributes
#[cfg(test)]
pub(crate) const NFTA_HOOK_HOOKNUM: u16 = 1;
#[cfg(test)]
pub(crate) const NFTA_HOOK_PRIORITY: u16 = 2;

// enum nft_table_attributes
pub(crate) const NFTA_TABLE_NAME: u16 = 1;

// enum nft_chain_attributes
pub(crate) const NFTA_CHAIN_TABLE: u16 = 1;
pub(crate) const NFTA_CHAIN_NAME: u16 = 3;
pub(crate) const NFTA_CHAIN_HOOK: u16 = 4;
pub(crate) const NFTA_CHAIN_POLICY: u16 = 5;
pub(crate) const NFTA_CHAIN_COUNTERS: u16 = 8;

// enum nft_rule_attributes
pub(crate) const NFTA_RULE_TABLE: u16 = 1;
pub(crate) const NFTA_RULE_CHAIN: u16 = 2;
#[cfg(test)]
pub(crate) const NFTA_RULE_HANDLE: u16 = 3;
pub(crate) const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub(crate) const NFTA_RULE_USERDATA: u16 = 7;

// enum nft_data_attributes
pub(crate) const NFTA_DATA_VALUE: u16 = 1;
pub(crate) const NFTA_DATA_VERDICT: u16 = 2;

// enum nft_verdict_attributes
pub(crate) const NFTA_VERDICT_CODE: u16 = 1;
pub(crate) const NFTA_VERDICT_CHAIN: u16 = 2;

// enum nft_expr_attributes
pub(crate) const NFTA_EXPR_NAME: u16 = 1;
pub(crate) const NFTA_EXPR_DATA: u16 = 2;

// enum nft_immediate_attributes
pub(crate) const NFTA_IMMEDIATE_DREG: u16 = 1;
pub(crate) const NFTA_IMMEDIATE_DATA: u16 = 2;

// enum nft_bitwise_ops (`NFT_BITWISE_MASK_XOR` was `NFT_BITWISE_BOOL`)
pub(crate) const NFT_BITWISE_MASK_XOR: u32 = 0;
pub(crate) const NFT_BITWISE_LSHIFT: u32 = 1;

// enum nft_bitwise_attributes
pub(crate) const NFTA_BITWISE_SREG: u16 = 1;
pub(crate) const NFTA_BITWISE_DREG: u16 = 2;
#[cfg(test)]
pub(crate) const NFTA_BITWISE_LEN: u16 = 3;
pub(crate) const NFTA_BITWISE_MASK: u16 = 4;
pub(crate) const NFTA_BITWISE_XOR: u16 = 5;
pub(crate) const NFTA_BITWISE_OP: u16 = 6;
pub(crate) const NFTA_BITWISE_DATA: u16 = 7;

// enum nft_cmp_ops
pub(crate) const NFT_CMP_EQ: u32 = 0;
pub(crate) const NFT_CMP_NEQ: u32 = 1;
pub(crate) const NFT_CMP_LT: u32 = 2;
pub(crate) const NFT_CMP_LTE: u32 = 3;
pub(crate) const NFT_CMP_GT: u32 = 4;
pub(crate) const NFT_CMP_GTE: u32 = 5;

// enum nft_cmp_attributes
pub(crate) const NFTA_CMP_SREG: u16 = 1;
pub(crate) const NFTA_CMP_OP: u16 = 2;
pub(crate) const NFTA_CMP_DATA: u16 = 3;

// enum nft_range_ops
pub(crate) const NFT_RANGE_EQ: u32 = 0;
pub(crate) const NFT_RANGE_NEQ: u32 = 1;

// enum nft_range_attributes
pub(crate) const NFTA_RANGE_SREG: u16 = 1;
pub(crate) const NFTA_RANGE_OP: u16 = 2;
pub(crate) const NFTA_RANGE_FROM_DATA: u16 = 3;
pub(crate) const NFTA_RANGE_TO_DATA: u16 = 4;

// enum nft_lookup_flags
pub(crate) const NFT_LOOKUP_F_INV: u32 = 1;

// enum nft_lookup_attributes
pub(crate) const NFTA_LOOKUP_SET: u16 = 1;
pub(crate) const NFTA_LOOKUP_SREG: u16 = 2;
pub(crate) const NFTA_LOOKUP_DREG: u16 = 3;
pub(crate) const NFTA_LOOKUP_FLAGS: u16 = 5;

// enum nft_payload_bases
pub(crate) const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub(crate) const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;

// enum nft_payload_attributes
pub(crate) const NFTA_PAYLOAD_DREG: u16 = 1;
pub(crate) const NFTA_PAYLOAD_BASE: u16 = 2;
pub(crate) const NFTA_PAYLOAD_OFFSET: u16 = 3;
pub(crate) const NFTA_PAYLOAD_LEN: u16 = 4;
pub(crate) const NFTA_PAYLOAD_SREG: u16 = 5;

// enum nft_meta_keys (`NFT_META_IIFTYPE` is the header's alias of `NFT_META_IFTYPE`)
pub(crate) const NFT_META_LEN: u32 = 0;
pub(crate) const NFT_META_PROTOCOL: u32 = 1;
pub(crate) const NFT_META_PRIORITY: u32 = 2;
pub(crate) const NFT_META_MARK: u32 = 3;
pub(crate) const NFT_META_IIF: u32 = 4;
pub(crate) const NFT_META_OIF: u32 = 5;
pub(crate) const NFT_META_IIFNAME: u32 = 6;
pub(crate) const NFT_META_OIFNAME: u32 = 7;
pub(crate) const NFT_META_IIFTYPE: u32 = 8;
pub(crate) const NFT_META_OIFTYPE: u32 = 9;
pub(crate) const NFT_META_SKUID: u32 = 10;
pub(crate) const NFT_META_SKGID: u32 = 11;
pub(crate) const NFT_META_NFTRACE: u32 = 12;
pub(crate) const NFT_META_NFPROTO: u32 = 15;
pub(crate) const NFT_META_L4PROTO: u32 = 16;
pub(crate) const NFT_META_PKTTYPE: u32 = 19;
pub(crate) const NFT_META_CPU: u32 = 20;
pub(crate) const NFT_META_CGROUP: u32 = 23;
pub(crate) const NFT_META_PRANDOM: u32 = 24;

// enum nft_meta_attributes
pub(crate) const NFTA_META_DREG: u16 = 1;
pub(crate) const NFTA_META_KEY: u16 = 2;
pub(crate) const NFTA_META_SREG: u16 = 3;

// enum nft_ct_keys
pub(crate) const NFT_CT_STATE: u32 = 0;
pub(crate) const NFT_CT_MARK: u32 = 3;

// enum nft_ct_attributes
pub(crate) const NFTA_CT_DREG: u16 = 1;
pub(crate) const NFTA_CT_KEY: u16 = 2;
pub(crate) const NFTA_CT_DIRECTION: u16 = 3;
pub(crate) const NFTA_CT_SREG: u16 = 4;

// enum ip_conntrack_dir (`linux/netfilter/nf_conntrack_tuple_common.h`): `NFTA_CT_DIRECTION`.
pub(crate) const IP_CT_DIR_ORIGINAL: u8 = 0;
pub(crate) const IP_CT_DIR_REPLY: u8 = 1;

// enum nft_limit_type
pub(crate) const NFT_LIMIT_PKTS: u32 = 0;

// enum nft_limit_attributes
pub(crate) const NFTA_LIMIT_RATE: u16 = 1;
pub(crate) const NFTA_LIMIT_UNIT: u16 = 2;
pub(crate) const NFTA_LIMIT_BURST: u16 = 3;
pub(crate) const NFTA_LIMIT_TYPE: u16 = 4;
pub(crate) const NFTA_LIMIT_FLAGS: u16 = 5;

// enum nft_counter_attributes
pub(crate) const NFTA_COUNTER_BYTES: u16 = 1;
pub(crate) const NFTA_COUNTER_PACKETS: u16 = 2;

// enum nft_log_attributes
pub(crate) const NFTA_LOG_GROUP: u16 = 1;
pub(crate) const NFTA_LOG_PREFIX: u16 = 2;
pub(crate) const NFTA_LOG_SNAPLEN: u16 = 3;
pub(crate) const NFTA_LOG_QTHRESHOLD: u16 = 4;

// enum nft_quota_attributes
pub(crate) const NFTA_QUOTA_BYTES: u16 = 1;

// enum nft_reject_types
pub(crate) const NFT_REJECT_TCP_RST: u32 = 1;

// enum nft_reject_attributes
pub(crate) const NFTA_REJECT_TYPE: u16 = 1;
pub(crate) const NFTA_REJECT_ICMP_CODE: u16 = 2;

// enum nft_nat_types
pub(crate) const NFT_NAT_SNAT: u32 = 0;

// enum nft_nat_attributes
pub(crate) const NFTA_NAT_TYPE: u16 = 1;
pub(crate) const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
pub(crate) const NFTA_NAT_REG_ADDR_MAX: u16 = 4;
pub(crate) const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
pub(crate) const NFTA_NAT_REG_PROTO_MAX: u16 = 6;

// enum nft_match_attributes (`linux/netfilter/nf_tables_compat.h`)
pub(crate) const NFTA_MATCH_NAME: u16 = 1;
pub(crate) const NFTA_MATCH_REV: u16 = 2;
pub(crate) const NFTA_MATCH_INFO: u16 = 3;

// enum nft_target_attributes (`linux/netfilter/nf_tables_compat.h`)
pub(crate) const NFTA_TARGET_NAME: u16 = 1;
pub(crate) const NFTA_TARGET_REV: u16 = 2;
pub(crate) const NFTA_TARGET_INFO: u16 = 3;
