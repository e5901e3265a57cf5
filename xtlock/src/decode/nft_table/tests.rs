use super::*;

/// One attribute: type, value, padded.
pub(crate) fn nla(kind: u16, v: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(((4 + v.len()) as u16).to_ne_bytes());
    b.extend(kind.to_ne_bytes());
    b.extend(v);
    b.resize(b.len().div_ceil(4) * 4, 0);
    b
}

fn nested(kind: u16, parts: &[Vec<u8>]) -> Vec<u8> {
    nla(kind | 0x8000, &parts.concat())
}

#[test]
fn a_chains_rules_are_asked_for_by_table_and_chain() {
    let r = chain_rules_request(NFPROTO_IPV4, "kube-proxy", "service-X-ns/web/tcp/http", 7);
    let mut want = Vec::new();
    // nlmsghdr: length, NFT_MSG_GETRULE of nf_tables, REQUEST | DUMP, seq 7, port 0.
    let body = [
        vec![NFPROTO_IPV4, 0, 0, 0],
        nla(NFTA_RULE_TABLE, &s("kube-proxy")),
        nla(NFTA_RULE_CHAIN, &s("service-X-ns/web/tcp/http")),
    ]
    .concat();
    want.extend(((16 + body.len()) as u32).to_ne_bytes());
    want.extend(((10u16 << 8) | 7).to_ne_bytes());
    want.extend(0x301u16.to_ne_bytes());
    want.extend(7u32.to_ne_bytes());
    want.extend(0u32.to_ne_bytes());
    want.extend(body);
    assert_eq!(r, want);
    assert_eq!(r.len() % 4, 0);
}

fn s(v: &str) -> Vec<u8> {
    let mut b = v.as_bytes().to_vec();
    b.push(0);
    b
}

fn be(v: u32) -> Vec<u8> {
    v.to_be_bytes().to_vec()
}

fn expr(name: &str, data: &[Vec<u8>]) -> Vec<u8> {
    nested(
        NFTA_LIST_ELEM,
        &[nla(NFTA_EXPR_NAME, &s(name)), nested(NFTA_EXPR_DATA, data)],
    )
}

/// An `NFTA_DATA_VALUE` nested in attribute `kind`.
fn value(kind: u16, v: &[u8]) -> Vec<u8> {
    nested(kind, &[nla(NFTA_DATA_VALUE, v)])
}

fn cmp(reg: u32, op: u32, v: &[u8]) -> Vec<u8> {
    expr(
        "cmp",
        &[
            nla(NFTA_CMP_SREG, &be(reg)),
            nla(NFTA_CMP_OP, &be(op)),
            value(NFTA_CMP_DATA, v),
        ],
    )
}

/// A meta load into register 1.
fn meta(key: u32) -> Vec<u8> {
    expr(
        "meta",
        &[
            nla(NFTA_META_DREG, &be(NFT_REG_1)),
            nla(NFTA_META_KEY, &be(key)),
        ],
    )
}

/// `meta KEY set` from register 1.
fn meta_set(key: u32) -> Vec<u8> {
    expr(
        "meta",
        &[
            nla(NFTA_META_KEY, &be(key)),
            nla(NFTA_META_SREG, &be(NFT_REG_1)),
        ],
    )
}

/// A payload load into register 1.
fn payload(base: u32, off: u32, len: u32) -> Vec<u8> {
    expr(
        "payload",
        &[
            nla(NFTA_PAYLOAD_DREG, &be(NFT_REG_1)),
            nla(NFTA_PAYLOAD_BASE, &be(base)),
            nla(NFTA_PAYLOAD_OFFSET, &be(off)),
            nla(NFTA_PAYLOAD_LEN, &be(len)),
        ],
    )
}

/// An immediate of `v` into register 1.
fn immediate(v: &[u8]) -> Vec<u8> {
    expr(
        "immediate",
        &[
            nla(NFTA_IMMEDIATE_DREG, &be(NFT_REG_1)),
            value(NFTA_IMMEDIATE_DATA, v),
        ],
    )
}

fn verdict(code: i32, chain: Option<&str>) -> Vec<u8> {
    let mut v = vec![nla(NFTA_VERDICT_CODE, &code.to_be_bytes())];
    if let Some(c) = chain {
        v.push(nla(NFTA_VERDICT_CHAIN, &s(c)));
    }
    expr(
        "immediate",
        &[
            nla(NFTA_IMMEDIATE_DREG, &be(NFT_REG_VERDICT)),
            nested(NFTA_IMMEDIATE_DATA, &[nested(NFTA_DATA_VERDICT, &v)]),
        ],
    )
}

/// Register 1 `& mask ^ 0`.
fn bitwise(mask: &[u8]) -> Vec<u8> {
    expr(
        "bitwise",
        &[
            nla(NFTA_BITWISE_SREG, &be(NFT_REG_1)),
            nla(NFTA_BITWISE_DREG, &be(NFT_REG_1)),
            nla(NFTA_BITWISE_LEN, &be(mask.len() as u32)),
            value(NFTA_BITWISE_MASK, mask),
            value(NFTA_BITWISE_XOR, &vec![0; mask.len()]),
        ],
    )
}

/// A rule message's attributes: its table and chain, expressions and userdata.
fn rule_msg(table: &str, chain: &str, exprs: &[Vec<u8>], udata: Option<&[u8]>) -> Vec<u8> {
    let mut m = [
        nla(NFTA_RULE_TABLE, &s(table)),
        nla(NFTA_RULE_CHAIN, &s(chain)),
        nla(NFTA_RULE_HANDLE, &7u64.to_be_bytes()),
        nested(NFTA_RULE_EXPRESSIONS, exprs),
    ]
    .concat();
    if let Some(u) = udata {
        m.extend(nla(NFTA_RULE_USERDATA, u));
    }
    m
}

/// iptables-nft's `-A KUBE-FIREWALL -m comment --comment "..." -m mark --mark
/// 0x8000/0x8000 -j DROP` (the comment as a compat match, the mark native), as a
/// rule message's attributes in `table`; without the mark when `stripped`.
fn firewall_rule_in(table: &str, stripped: bool) -> Vec<u8> {
    let mut comment = vec![0u8; 256];
    comment[..6].copy_from_slice(b"kp fw!");
    let mut exprs = vec![expr(
        "match",
        &[
            nla(NFTA_MATCH_NAME, &s("comment")),
            nla(NFTA_MATCH_REV, &be(0)),
            nla(NFTA_MATCH_INFO, &comment),
        ],
    )];
    if !stripped {
        exprs.push(meta(NFT_META_MARK));
        exprs.push(bitwise(&0x8000u32.to_ne_bytes()));
        exprs.push(cmp(NFT_REG_1, NFT_CMP_EQ, &0x8000u32.to_ne_bytes()));
    }
    exprs.push(expr(
        "counter",
        &[
            nla(NFTA_COUNTER_BYTES, &[0; 8]),
            nla(NFTA_COUNTER_PACKETS, &[0; 8]),
        ],
    ));
    exprs.push(verdict(NF_DROP, None));
    rule_msg(table, "KUBE-FIREWALL", &exprs, None)
}

pub(crate) fn firewall_rule(stripped: bool) -> Vec<u8> {
    firewall_rule_in("filter", stripped)
}

/// `! -s 10.0.0.0/8 -d 10.96.0.10/32 -i eth+ -p tcp -m tcp --dport 53` and a userdata
/// comment, jumping to KUBE-SVC-ABC, in the order nft would write it.
fn service_rule(table: &str) -> Vec<u8> {
    let exprs = vec![
        meta(NFT_META_L4PROTO),
        cmp(NFT_REG_1, NFT_CMP_EQ, &[6]),
        payload(NFT_PAYLOAD_NETWORK_HEADER, 16, 4),
        cmp(NFT_REG_1, NFT_CMP_EQ, &[10, 96, 0, 10]),
        payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2),
        cmp(NFT_REG_1, NFT_CMP_EQ, &53u16.to_be_bytes()),
        payload(NFT_PAYLOAD_NETWORK_HEADER, 12, 1),
        cmp(NFT_REG_1, NFT_CMP_NEQ, &[10]),
        meta(NFT_META_IIFNAME),
        cmp(NFT_REG_1, NFT_CMP_EQ, b"eth"),
        verdict(NFT_JUMP, Some("KUBE-SVC-ABC")),
    ];
    // A userdata comment (type, length, text with its NUL).
    let mut udata = vec![NFTNL_UDATA_RULE_COMMENT, 4];
    udata.extend(b"svc\0");
    rule_msg(table, "KUBE-SERVICES", &exprs, Some(&udata))
}

#[test]
fn native_tables_rules_render_in_nfts_words_verdict_last() {
    let r = parse_rule(
        NFPROTO_IPV4,
        &firewall_rule_in("kube-proxy", false),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(
        (r.table.as_str(), r.chain.as_str()),
        ("kube-proxy", "KUBE-FIREWALL")
    );
    assert_eq!(
        r.rule.0,
        [
            "-m comment --comment \"kp fw!\"",
            "meta mark & 0x8000 == 0x8000",
            "-j DROP"
        ]
    );
    assert_eq!(r.rule.comment(), Some("\"kp fw!\""));
    let stripped = parse_rule(
        NFPROTO_IPV4,
        &firewall_rule_in("kube-proxy", true),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(stripped.rule.matches().count(), 0);
    assert_eq!(stripped.rule.target(), "-j DROP");

    let r = parse_rule(NFPROTO_IPV4, &service_rule("kube-proxy"), &mut |_| None).unwrap();
    assert_eq!(
        r.rule.0,
        [
            "-m comment --comment \"svc\"",
            "meta l4proto tcp",
            "ip daddr 10.96.0.10",
            "tcp dport 53",
            "ip saddr != 10.0.0.0/8",
            "meta iifname \"eth*\"",
            "-j KUBE-SVC-ABC"
        ]
    );
    assert_eq!(r.rule.jump(), Some("KUBE-SVC-ABC"));
    assert_eq!(r.rule.comment(), Some("\"svc\""));
    assert!(!iptables_words(&r.rule));
}

#[test]
fn iptables_tables_rules_render_as_iptables_nft_save_writes_them() {
    let r = parse_rule(NFPROTO_IPV4, &firewall_rule(false), &mut |_| None).unwrap();
    assert_eq!(
        r.rule.0,
        [
            "-m comment --comment \"kp fw!\"",
            "-m mark --mark 0x8000/0x8000",
            "-j DROP"
        ]
    );
    assert_eq!(r.rule.comment(), Some("\"kp fw!\""));
    assert!(iptables_words(&r.rule));
    let stripped = parse_rule(NFPROTO_IPV4, &firewall_rule(true), &mut |_| None).unwrap();
    assert_eq!(
        stripped.rule.text(),
        "-m comment --comment \"kp fw!\" -j DROP"
    );

    // The head first whatever the expressions' order, the userdata's comment after the
    // matches (bare, as the save leaves a plain word).
    let r = parse_rule(NFPROTO_IPV4, &service_rule("filter"), &mut |_| None).unwrap();
    assert_eq!(
        r.rule.0,
        [
            "! -s 10.0.0.0/8",
            "-d 10.96.0.10/32",
            "-i eth+",
            "-p tcp",
            "-m tcp --dport 53",
            "-m comment --comment svc",
            "-j KUBE-SVC-ABC"
        ]
    );
    // Only iptables' own tables of family ip and ip6.
    assert!(!iptables_words(
        &parse_rule(NFPROTO_INET, &service_rule("filter"), &mut |_| None)
            .unwrap()
            .rule
    ));

    // ip6tables: `-s fd00::/ffff:0:ffff:: ! -o eth0 -p udp -m udp ! --sport 53 --dport
    // 8000:8100 -m limit --limit 2/min -g X`, `-f`-less, a `-m` match kept as xt.
    let exprs = vec![
        payload(NFT_PAYLOAD_NETWORK_HEADER, 8, 16),
        bitwise(
            &"ffff:0:ffff::"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets(),
        ),
        cmp(
            NFT_REG_1,
            NFT_CMP_EQ,
            &"fd00::".parse::<std::net::Ipv6Addr>().unwrap().octets(),
        ),
        meta(NFT_META_OIFNAME),
        cmp(NFT_REG_1, NFT_CMP_NEQ, b"eth0\0"),
        meta(NFT_META_L4PROTO),
        cmp(NFT_REG_1, NFT_CMP_EQ, &[17]),
        payload(NFT_PAYLOAD_TRANSPORT_HEADER, 0, 2),
        cmp(NFT_REG_1, NFT_CMP_NEQ, &53u16.to_be_bytes()),
        payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2),
        expr(
            "range",
            &[
                nla(NFTA_RANGE_SREG, &be(NFT_REG_1)),
                nla(NFTA_RANGE_OP, &be(NFT_RANGE_EQ)),
                value(NFTA_RANGE_FROM_DATA, &8000u16.to_be_bytes()),
                value(NFTA_RANGE_TO_DATA, &8100u16.to_be_bytes()),
            ],
        ),
        expr(
            "limit",
            &[
                nla(NFTA_LIMIT_RATE, &2u64.to_be_bytes()),
                nla(NFTA_LIMIT_UNIT, &60u64.to_be_bytes()),
                nla(NFTA_LIMIT_BURST, &be(5)),
                nla(NFTA_LIMIT_TYPE, &be(NFT_LIMIT_PKTS)),
                nla(NFTA_LIMIT_FLAGS, &be(0)),
            ],
        ),
        verdict(NFT_GOTO, Some("X")),
    ];
    let r = parse_rule(
        NFPROTO_IPV6,
        &rule_msg("filter", "INPUT", &exprs, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(
        r.rule.text(),
        "-s fd00::/ffff:0:ffff:: ! -o eth0 -p udp -m udp ! --sport 53 --dport 8000:8100 \
         -m limit --limit 2/min -g X"
    );

    // `-j NFLOG --nflog-prefix hi --nflog-group 5` (a native log to a group), `-j TRACE`.
    let exprs = vec![expr(
        "log",
        &[
            nla(NFTA_LOG_GROUP, &5u16.to_be_bytes()),
            nla(NFTA_LOG_PREFIX, &s("hi")),
        ],
    )];
    let r = parse_rule(
        NFPROTO_IPV4,
        &rule_msg("filter", "INPUT", &exprs, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(r.rule.text(), "-j NFLOG --nflog-prefix hi --nflog-group 5");
    let exprs = vec![immediate(&1u32.to_ne_bytes()), meta_set(NFT_META_NFTRACE)];
    let r = parse_rule(
        NFPROTO_IPV4,
        &rule_msg("raw", "PREROUTING", &exprs, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(r.rule.text(), "-j TRACE");
    // A log to the kernel's log has none: nft's words.
    let exprs = vec![expr("log", &[nla(NFTA_LOG_PREFIX, &s("hi"))])];
    let r = parse_rule(
        NFPROTO_IPV4,
        &rule_msg("filter", "INPUT", &exprs, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(r.rule.0, ["log prefix \"hi\"", "-j CONTINUE"]);

    // `! -i +`: equal to a name no interface has.
    let exprs = vec![
        meta(NFT_META_IIFNAME),
        cmp(NFT_REG_1, NFT_CMP_EQ, b"INVAL/D\0"),
        verdict(NF_ACCEPT, None),
    ];
    let r = parse_rule(
        NFPROTO_IPV4,
        &rule_msg("filter", "INPUT", &exprs, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(r.rule.text(), "! -i + -j ACCEPT");

    // `-f`, `--tcp-flags`, a native MARK target.
    let exprs = vec![
        payload(NFT_PAYLOAD_NETWORK_HEADER, 6, 2),
        bitwise(&[0x1f, 0xff]),
        cmp(NFT_REG_1, NFT_CMP_NEQ, &[0, 0]),
        meta(NFT_META_L4PROTO),
        cmp(NFT_REG_1, NFT_CMP_EQ, &[6]),
        payload(NFT_PAYLOAD_TRANSPORT_HEADER, 13, 1),
        bitwise(&[0x17]),
        cmp(NFT_REG_1, NFT_CMP_EQ, &[0x02]),
        immediate(&5u32.to_ne_bytes()),
        meta_set(NFT_META_MARK),
    ];
    let r = parse_rule(
        NFPROTO_IPV4,
        &rule_msg("mangle", "INPUT", &exprs, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(
        r.rule.text(),
        "-p tcp -f -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -j MARK --set-xmark 0x5/0xffffffff"
    );
}

#[test]
fn rules_iptables_nft_cannot_express_keep_nfts_words() {
    // `ct state established accept`, `tcp dport @ports accept`: no iptables option.
    let ct = vec![
        expr(
            "ct",
            &[
                nla(NFTA_CT_DREG, &be(NFT_REG_1)),
                nla(NFTA_CT_KEY, &be(NFT_CT_STATE)),
            ],
        ),
        bitwise(&2u32.to_ne_bytes()),
        cmp(NFT_REG_1, NFT_CMP_NEQ, &0u32.to_ne_bytes()),
        verdict(NF_ACCEPT, None),
    ];
    let r = parse_rule(
        NFPROTO_IPV4,
        &rule_msg("filter", "INPUT", &ct, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(r.rule.0, ["ct state established", "-j ACCEPT"]);
    assert!(!iptables_words(&r.rule));
    let set = vec![
        meta(NFT_META_L4PROTO),
        cmp(NFT_REG_1, NFT_CMP_EQ, &[6]),
        payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2),
        expr(
            "lookup",
            &[
                nla(NFTA_LOOKUP_SET, &s("ports")),
                nla(NFTA_LOOKUP_SREG, &be(NFT_REG_1)),
            ],
        ),
        verdict(NF_ACCEPT, None),
    ];
    let r = parse_rule(
        NFPROTO_IPV4,
        &rule_msg("filter", "INPUT", &set, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(
        r.rule.0,
        ["meta l4proto tcp", "tcp dport @ports", "-j ACCEPT"]
    );
    // A port match without a protocol: nft's `th dport`.
    let th = vec![
        payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2),
        cmp(NFT_REG_1, NFT_CMP_EQ, &80u16.to_be_bytes()),
    ];
    let r = parse_rule(
        NFPROTO_IPV4,
        &rule_msg("filter", "INPUT", &th, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(r.rule.0, ["th dport 80", "-j CONTINUE"]);
    // No verdict at all is a rule iptables writes (`-m recent --set`): no target.
    let none = vec![meta(NFT_META_L4PROTO), cmp(NFT_REG_1, NFT_CMP_EQ, &[6])];
    let r = parse_rule(
        NFPROTO_IPV4,
        &rule_msg("filter", "INPUT", &none, None),
        &mut |_| None,
    )
    .unwrap();
    assert_eq!(r.rule.0, ["-p tcp"]);
}

#[test]
fn chains_tables_and_a_dump() {
    let chain = [
        nla(NFTA_CHAIN_TABLE, &s("filter")),
        nla(NFTA_CHAIN_NAME, &s("INPUT")),
        nested(
            NFTA_CHAIN_HOOK,
            // `NF_INET_LOCAL_IN`, priority 0.
            &[
                nla(NFTA_HOOK_HOOKNUM, &be(1)),
                nla(NFTA_HOOK_PRIORITY, &be(0)),
            ],
        ),
        nla(NFTA_CHAIN_POLICY, &NF_DROP.to_be_bytes()),
    ]
    .concat();
    let c = parse_chain(&chain).unwrap();
    assert_eq!(c.policy.as_deref(), Some("DROP"));
    let user = [
        nla(NFTA_CHAIN_TABLE, &s("filter")),
        nla(NFTA_CHAIN_NAME, &s("KUBE-FIREWALL")),
    ]
    .concat();
    assert_eq!(parse_chain(&user).unwrap().policy, None);
    assert_eq!(
        parse_table(&nla(NFTA_TABLE_NAME, &s("filter"))).unwrap(),
        "filter"
    );

    // A datagram: one rule message, then DONE.
    let mut d = Vec::new();
    let attrs = firewall_rule(false);
    let len = NLMSG_HDR + NFGENMSG + attrs.len();
    d.extend((len as u32).to_ne_bytes());
    d.extend(((10u16 << 8) | u16::from(NFT_MSG_NEWRULE)).to_ne_bytes());
    d.extend(2u16.to_ne_bytes());
    d.extend([0u8; 8]);
    d.extend([NFPROTO_IPV4, 0, 0, 9]);
    d.extend(&attrs);
    d.extend(16u32.to_ne_bytes());
    d.extend(NLMSG_DONE.to_ne_bytes());
    d.extend([0u8; 10]);
    let m = messages(&d).unwrap();
    assert_eq!(m.len(), 2);
    assert_eq!(
        m[0],
        Msg::Object(Object {
            msg: NFT_MSG_NEWRULE,
            family: NFPROTO_IPV4,
            generation: 9,
            interrupted: false,
            attrs: &attrs
        })
    );
    assert_eq!(m[1], Msg::Done);
    let rule = parse_rule(NFPROTO_IPV4, &attrs, &mut |_| None).unwrap();
    let t = assemble(
        vec![(NFPROTO_IPV4, "filter".into())],
        vec![(NFPROTO_IPV4, parse_chain(&user).unwrap())],
        vec![
            (NFPROTO_IPV4, rule),
            (
                NFPROTO_IPV6,
                parse_rule(NFPROTO_IPV6, &attrs, &mut |_| None).unwrap(),
            ),
        ],
    );
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].family, "nft ip");
    assert_eq!(t[0].chains[0].rules.len(), 1);

    // A kernel error.
    let mut e = Vec::new();
    e.extend(36u32.to_ne_bytes());
    e.extend(NLMSG_ERROR.to_ne_bytes());
    e.extend([0u8; 10]);
    e.extend((-1i32).to_ne_bytes());
    e.extend([0u8; 16]);
    assert!(matches!(messages(&e), Err(NftError::Kernel(_, 1))));
}

#[test]
fn damaged_input_is_an_error_not_a_panic() {
    let r = firewall_rule(false);
    for cut in 0..r.len() {
        let _ = parse_rule(NFPROTO_IPV4, &r[..cut], &mut |_| None);
    }
    let mut bad = r.clone();
    bad[0] = 0xff; // the first attribute's length runs past the end
    assert!(parse_rule(NFPROTO_IPV4, &bad, &mut |_| None).is_err());
    assert!(
        parse_rule(NFPROTO_IPV4, &[], &mut |_| None).is_err(),
        "a rule without its table and chain"
    );
    assert!(messages(&[1, 2, 3]).is_err());
    let mut short = vec![0u8; 20];
    short[0] = 200;
    assert!(messages(&short).is_err());
    for b in 0..=255u8 {
        let mut flipped = r.clone();
        flipped[b as usize % r.len()] ^= b;
        let _ = parse_rule(NFPROTO_IPV4, &flipped, &mut |_| None);
        let _ = parse_chain(&flipped);
    }
}

proptest::proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(b in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
        let _ = messages(&b);
        let _ = parse_rule(NFPROTO_INET, &b, &mut |_| None);
        let _ = parse_chain(&b);
        let _ = parse_table(&b);
    }
}
