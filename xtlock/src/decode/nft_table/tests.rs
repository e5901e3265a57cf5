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
    let r = chain_rules_request(2, "kube-proxy", "service-X-ns/web/tcp/http", 7);
    let mut want = Vec::new();
    // nlmsghdr: length, NFT_MSG_GETRULE of nf_tables, REQUEST | DUMP, seq 7, port 0.
    let body = [
        vec![2, 0, 0, 0],
        nla(1, &s("kube-proxy")),
        nla(2, &s("service-X-ns/web/tcp/http")),
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
    nested(1, &[nla(1, &s(name)), nested(2, data)])
}

fn cmp(reg: u32, op: u32, v: &[u8]) -> Vec<u8> {
    expr(
        "cmp",
        &[nla(1, &be(reg)), nla(2, &be(op)), nested(3, &[nla(1, v)])],
    )
}

fn meta(key: u32) -> Vec<u8> {
    expr("meta", &[nla(1, &be(1)), nla(2, &be(key))])
}

fn payload(base: u32, off: u32, len: u32) -> Vec<u8> {
    expr(
        "payload",
        &[
            nla(1, &be(1)),
            nla(2, &be(base)),
            nla(3, &be(off)),
            nla(4, &be(len)),
        ],
    )
}

fn verdict(code: i32, chain: Option<&str>) -> Vec<u8> {
    let mut v = vec![nla(1, &code.to_be_bytes())];
    if let Some(c) = chain {
        v.push(nla(2, &s(c)));
    }
    expr("immediate", &[nla(1, &be(0)), nested(2, &[nested(2, &v)])])
}

fn bitwise(mask: &[u8]) -> Vec<u8> {
    expr(
        "bitwise",
        &[
            nla(1, &be(1)),
            nla(2, &be(1)),
            nla(3, &be(mask.len() as u32)),
            nested(4, &[nla(1, mask)]),
            nested(5, &[nla(1, &vec![0; mask.len()])]),
        ],
    )
}

/// A rule message's attributes: its table and chain, expressions and userdata.
fn rule_msg(table: &str, chain: &str, exprs: &[Vec<u8>], udata: Option<&[u8]>) -> Vec<u8> {
    let mut m = [
        nla(1, &s(table)),
        nla(2, &s(chain)),
        nla(3, &7u64.to_be_bytes()),
        nested(4, exprs),
    ]
    .concat();
    if let Some(u) = udata {
        m.extend(nla(7, u));
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
        &[nla(1, &s("comment")), nla(2, &be(0)), nla(3, &comment)],
    )];
    if !stripped {
        exprs.push(meta(3));
        exprs.push(bitwise(&0x8000u32.to_ne_bytes()));
        exprs.push(cmp(1, 0, &0x8000u32.to_ne_bytes()));
    }
    exprs.push(expr("counter", &[nla(1, &[0; 8]), nla(2, &[0; 8])]));
    exprs.push(verdict(0, None));
    rule_msg(table, "KUBE-FIREWALL", &exprs, None)
}

pub(crate) fn firewall_rule(stripped: bool) -> Vec<u8> {
    firewall_rule_in("filter", stripped)
}

/// `! -s 10.0.0.0/8 -d 10.96.0.10/32 -i eth+ -p tcp -m tcp --dport 53` and a userdata
/// comment, jumping to KUBE-SVC-ABC, in the order nft would write it.
fn service_rule(table: &str) -> Vec<u8> {
    let exprs = vec![
        meta(16),
        cmp(1, 0, &[6]),
        payload(1, 16, 4),
        cmp(1, 0, &[10, 96, 0, 10]),
        payload(2, 2, 2),
        cmp(1, 0, &53u16.to_be_bytes()),
        payload(1, 12, 1),
        cmp(1, 1, &[10]),
        meta(6),
        cmp(1, 0, b"eth"),
        verdict(-3, Some("KUBE-SVC-ABC")),
    ];
    // A userdata comment (type 0, length, text with its NUL).
    let mut udata = vec![0u8, 4];
    udata.extend(b"svc\0");
    rule_msg(table, "KUBE-SERVICES", &exprs, Some(&udata))
}

#[test]
fn native_tables_rules_render_in_nfts_words_verdict_last() {
    let r = parse_rule(2, &firewall_rule_in("kube-proxy", false), &mut |_| None).unwrap();
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
    let stripped = parse_rule(2, &firewall_rule_in("kube-proxy", true), &mut |_| None).unwrap();
    assert_eq!(stripped.rule.matches().count(), 0);
    assert_eq!(stripped.rule.target(), "-j DROP");

    let r = parse_rule(2, &service_rule("kube-proxy"), &mut |_| None).unwrap();
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
    let r = parse_rule(2, &firewall_rule(false), &mut |_| None).unwrap();
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
    let stripped = parse_rule(2, &firewall_rule(true), &mut |_| None).unwrap();
    assert_eq!(
        stripped.rule.text(),
        "-m comment --comment \"kp fw!\" -j DROP"
    );

    // The head first whatever the expressions' order, the userdata's comment after the
    // matches (bare, as the save leaves a plain word).
    let r = parse_rule(2, &service_rule("filter"), &mut |_| None).unwrap();
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
        &parse_rule(1, &service_rule("filter"), &mut |_| None)
            .unwrap()
            .rule
    ));

    // ip6tables: `-s fd00::/ffff:0:ffff:: ! -o eth0 -p udp -m udp ! --sport 53 --dport
    // 8000:8100 -m limit --limit 2/min -g X`, `-f`-less, a `-m` match kept as xt.
    let exprs = vec![
        payload(1, 8, 16),
        bitwise(
            &"ffff:0:ffff::"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets(),
        ),
        cmp(
            1,
            0,
            &"fd00::".parse::<std::net::Ipv6Addr>().unwrap().octets(),
        ),
        meta(7),
        cmp(1, 1, b"eth0\0"),
        meta(16),
        cmp(1, 0, &[17]),
        payload(2, 0, 2),
        cmp(1, 1, &53u16.to_be_bytes()),
        payload(2, 2, 2),
        expr(
            "range",
            &[
                nla(1, &be(1)),
                nla(2, &be(0)),
                nested(3, &[nla(1, &8000u16.to_be_bytes())]),
                nested(4, &[nla(1, &8100u16.to_be_bytes())]),
            ],
        ),
        expr(
            "limit",
            &[
                nla(1, &2u64.to_be_bytes()),
                nla(2, &60u64.to_be_bytes()),
                nla(3, &be(5)),
                nla(4, &be(0)),
                nla(5, &be(0)),
            ],
        ),
        verdict(-4, Some("X")),
    ];
    let r = parse_rule(10, &rule_msg("filter", "INPUT", &exprs, None), &mut |_| {
        None
    })
    .unwrap();
    assert_eq!(
        r.rule.text(),
        "-s fd00::/ffff:0:ffff:: ! -o eth0 -p udp -m udp ! --sport 53 --dport 8000:8100 \
         -m limit --limit 2/min -g X"
    );

    // `-j NFLOG --nflog-prefix hi --nflog-group 5` (a native log to a group), `-j TRACE`.
    let exprs = vec![expr(
        "log",
        &[nla(1, &5u16.to_be_bytes()), nla(2, &s("hi"))],
    )];
    let r = parse_rule(2, &rule_msg("filter", "INPUT", &exprs, None), &mut |_| None).unwrap();
    assert_eq!(r.rule.text(), "-j NFLOG --nflog-prefix hi --nflog-group 5");
    let exprs = vec![
        expr(
            "immediate",
            &[nla(1, &be(1)), nested(2, &[nla(1, &1u32.to_ne_bytes())])],
        ),
        expr("meta", &[nla(2, &be(12)), nla(3, &be(1))]),
    ];
    let r = parse_rule(2, &rule_msg("raw", "PREROUTING", &exprs, None), &mut |_| {
        None
    })
    .unwrap();
    assert_eq!(r.rule.text(), "-j TRACE");
    // A log to the kernel's log has none: nft's words.
    let exprs = vec![expr("log", &[nla(2, &s("hi"))])];
    let r = parse_rule(2, &rule_msg("filter", "INPUT", &exprs, None), &mut |_| None).unwrap();
    assert_eq!(r.rule.0, ["log prefix \"hi\"", "-j CONTINUE"]);

    // `! -i +`: equal to a name no interface has.
    let exprs = vec![meta(6), cmp(1, 0, b"INVAL/D\0"), verdict(1, None)];
    let r = parse_rule(2, &rule_msg("filter", "INPUT", &exprs, None), &mut |_| None).unwrap();
    assert_eq!(r.rule.text(), "! -i + -j ACCEPT");

    // `-f`, `--tcp-flags`, a native MARK target.
    let exprs = vec![
        payload(1, 6, 2),
        bitwise(&[0x1f, 0xff]),
        cmp(1, 1, &[0, 0]),
        meta(16),
        cmp(1, 0, &[6]),
        payload(2, 13, 1),
        bitwise(&[0x17]),
        cmp(1, 0, &[0x02]),
        expr(
            "immediate",
            &[nla(1, &be(1)), nested(2, &[nla(1, &5u32.to_ne_bytes())])],
        ),
        expr("meta", &[nla(2, &be(3)), nla(3, &be(1))]),
    ];
    let r = parse_rule(2, &rule_msg("mangle", "INPUT", &exprs, None), &mut |_| None).unwrap();
    assert_eq!(
        r.rule.text(),
        "-p tcp -f -m tcp --tcp-flags FIN,SYN,RST,ACK SYN -j MARK --set-xmark 0x5/0xffffffff"
    );
}

#[test]
fn rules_iptables_nft_cannot_express_keep_nfts_words() {
    // `ct state established accept`, `tcp dport @ports accept`: no iptables option.
    let ct = vec![
        expr("ct", &[nla(1, &be(1)), nla(2, &be(0))]),
        bitwise(&2u32.to_ne_bytes()),
        cmp(1, 1, &0u32.to_ne_bytes()),
        verdict(1, None),
    ];
    let r = parse_rule(2, &rule_msg("filter", "INPUT", &ct, None), &mut |_| None).unwrap();
    assert_eq!(r.rule.0, ["ct state established", "-j ACCEPT"]);
    assert!(!iptables_words(&r.rule));
    let set = vec![
        meta(16),
        cmp(1, 0, &[6]),
        payload(2, 2, 2),
        expr("lookup", &[nla(1, &s("ports")), nla(2, &be(1))]),
        verdict(1, None),
    ];
    let r = parse_rule(2, &rule_msg("filter", "INPUT", &set, None), &mut |_| None).unwrap();
    assert_eq!(
        r.rule.0,
        ["meta l4proto tcp", "tcp dport @ports", "-j ACCEPT"]
    );
    // A port match without a protocol: nft's `th dport`.
    let th = vec![payload(2, 2, 2), cmp(1, 0, &80u16.to_be_bytes())];
    let r = parse_rule(2, &rule_msg("filter", "INPUT", &th, None), &mut |_| None).unwrap();
    assert_eq!(r.rule.0, ["th dport 80", "-j CONTINUE"]);
    // No verdict at all is a rule iptables writes (`-m recent --set`): no target.
    let none = vec![meta(16), cmp(1, 0, &[6])];
    let r = parse_rule(2, &rule_msg("filter", "INPUT", &none, None), &mut |_| None).unwrap();
    assert_eq!(r.rule.0, ["-p tcp"]);
}

#[test]
fn chains_tables_and_a_dump() {
    let chain = [
        nla(1, &s("filter")),
        nla(3, &s("INPUT")),
        nested(4, &[nla(1, &be(1)), nla(2, &be(0))]),
        nla(5, &be(0)),
    ]
    .concat();
    let c = parse_chain(&chain).unwrap();
    assert_eq!(c.policy.as_deref(), Some("DROP"));
    let user = [nla(1, &s("filter")), nla(3, &s("KUBE-FIREWALL"))].concat();
    assert_eq!(parse_chain(&user).unwrap().policy, None);
    assert_eq!(parse_table(&nla(1, &s("filter"))).unwrap(), "filter");

    // A datagram: one rule message, then DONE.
    let mut d = Vec::new();
    let attrs = firewall_rule(false);
    let len = NLMSG_HDR + NFGENMSG + attrs.len();
    d.extend((len as u32).to_ne_bytes());
    d.extend(((10u16 << 8) | u16::from(NFT_MSG_NEWRULE)).to_ne_bytes());
    d.extend(2u16.to_ne_bytes());
    d.extend([0u8; 8]);
    d.extend([2, 0, 0, 9]);
    d.extend(&attrs);
    d.extend(16u32.to_ne_bytes());
    d.extend(NLMSG_DONE.to_ne_bytes());
    d.extend([0u8; 10]);
    let m = messages(&d).unwrap();
    assert_eq!(m.len(), 2);
    assert_eq!(
        m[0],
        Msg::Object {
            msg: NFT_MSG_NEWRULE,
            family: 2,
            generation: 9,
            interrupted: false,
            attrs: &attrs
        }
    );
    assert_eq!(m[1], Msg::Done);
    let rule = parse_rule(2, &attrs, &mut |_| None).unwrap();
    let t = assemble(
        vec![(2, "filter".into())],
        vec![(2, parse_chain(&user).unwrap())],
        vec![
            (2, rule),
            (10, parse_rule(10, &attrs, &mut |_| None).unwrap()),
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
        let _ = parse_rule(2, &r[..cut], &mut |_| None);
    }
    let mut bad = r.clone();
    bad[0] = 0xff; // the first attribute's length runs past the end
    assert!(parse_rule(2, &bad, &mut |_| None).is_err());
    assert!(
        parse_rule(2, &[], &mut |_| None).is_err(),
        "a rule without its table and chain"
    );
    assert!(messages(&[1, 2, 3]).is_err());
    let mut short = vec![0u8; 20];
    short[0] = 200;
    assert!(messages(&short).is_err());
    for b in 0..=255u8 {
        let mut flipped = r.clone();
        flipped[b as usize % r.len()] ^= b;
        let _ = parse_rule(2, &flipped, &mut |_| None);
        let _ = parse_chain(&flipped);
    }
}

proptest::proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(b in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
        let _ = messages(&b);
        let _ = parse_rule(1, &b, &mut |_| None);
        let _ = parse_chain(&b);
        let _ = parse_table(&b);
    }
}
