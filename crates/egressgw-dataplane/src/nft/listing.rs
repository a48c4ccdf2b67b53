//! The parser of `nft -j list`'s JSON.
//!
//! The listing is read as it streams: item by item, and a set's or map's
//! elements one by one, each dropped once taken. A gateway's table of tens
//! of thousands of elements never stands in memory as one JSON tree (at
//! 15 000 SNAT entries, that tree took about 40 MB for as long as the
//! reconcile read it, several times what the table's text and what is
//! kept of it take).

use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::*;

/// Parses `nft -j list table inet egressgw` into canonical form.
///
/// Interval elements come back as a plain address, a `prefix` object or a
/// `range` object (nft prints a range that is exactly one prefix as the
/// prefix); all three become an [`IpRange`]. Elements egressgw cannot
/// read (a source that is not one address) are skipped with a warning.
pub fn parse_table(json: &str) -> Result<Observed> {
    let mut obs = Observed::default();
    walk(json, "table", &mut |item| match item {
        Item::Elem(set, elem) => take_elem(set, &elem, &mut obs),
        Item::Set(name) => {
            obs.sets.insert(name);
        }
        Item::Other("counter", counter) => {
            obs.counters.insert(str_field(&counter, "name"));
        }
        Item::Other("chain", chain) => {
            let hook = chain.get("hook").map(|h| Hook {
                kind: str_field(&chain, "type"),
                hook: h.as_str().unwrap_or_default().into(),
                priority: chain
                    .get("prio")
                    .and_then(Value::as_i64)
                    .and_then(|p| i32::try_from(p).ok())
                    .unwrap_or_default(),
            });
            obs.chains
                .entry(str_field(&chain, "name"))
                .or_default()
                .hook = hook;
        }
        Item::Other("rule", rule) => {
            obs.chains
                .entry(str_field(&rule, "chain"))
                .or_default()
                .fingerprints
                .push(str_field(&rule, "comment"));
        }
        Item::Other(..) => {}
    })?;
    Ok(obs)
}

/// Parses `nft -j list counters table inet egressgw`: each counter
/// object's packets and bytes, by name.
pub fn parse_counters(json: &str) -> Result<BTreeMap<String, Counter>> {
    let mut counters = BTreeMap::new();
    walk(json, "counters table", &mut |item| {
        if let Item::Other("counter", c) = item {
            let number = |key: &str| c.get(key).and_then(Value::as_u64).unwrap_or_default();
            let counter = Counter {
                packets: number("packets"),
                bytes: number("bytes"),
            };
            counters.insert(str_field(&c, "name"), counter);
        }
    })?;
    Ok(counters)
}

/// One thing of a listing, as [`walk`] gives it.
enum Item<'a> {
    /// An element of the set or map of this name.
    Elem(&'a str, Value),
    /// The name of a set or map, after all its elements.
    Set(String),
    /// An item of another kind (`chain`, `rule`, `counter`, ...) and what
    /// it holds.
    Other(&'a str, Value),
}

/// What [`walk`] gives each item to.
type Take<'t> = &'t mut dyn FnMut(Item<'_>);

/// Gives `take` every item of `nft -j list <what> inet egressgw`'s output,
/// in order.
fn walk(json: &str, what: &str, take: Take<'_>) -> Result<()> {
    let bad = |message: String| Error::Nft {
        what: format!("parse list {what} {FAMILY} {TABLE}"),
        message,
    };
    let mut json = serde_json::Deserializer::from_str(json);
    let found = Root(take)
        .deserialize(&mut json)
        .and_then(|found| json.end().map(|()| found))
        .map_err(|e| bad(e.to_string()))?;
    found
        .then_some(())
        .ok_or_else(|| bad("no \"nftables\" array".into()))
}

/// Each part of the listing is read by its visitor: the seed asks the
/// deserializer for what that visitor takes.
macro_rules! seeds {
    ($($part:ty => $value:ty, $how:ident;)+) => {$(
        impl<'de> DeserializeSeed<'de> for $part {
            type Value = $value;

            fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<$value, D::Error> {
                d.$how(self)
            }
        }
    )+};
}

seeds! {
    Root<'_> => bool, deserialize_map;
    Items<'_> => (), deserialize_seq;
    One<'_> => (), deserialize_map;
    Set<'_> => (), deserialize_map;
    Elems<'_, '_> => (), deserialize_seq;
}

/// The listing's root object; whether it has the `nftables` array.
struct Root<'t>(Take<'t>);

impl<'de> Visitor<'de> for Root<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object with an \"nftables\" array")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        let mut found = false;
        while let Some(key) = map.next_key::<String>()? {
            if key == "nftables" && !found {
                map.next_value_seed(Items(&mut *self.0))?;
                found = true;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// The `nftables` array.
struct Items<'t>(Take<'t>);

impl<'de> Visitor<'de> for Items<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of items")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(One(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

/// One item: an object whose key says its kind.
struct One<'t>(Take<'t>);

impl<'de> Visitor<'de> for One<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an item object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(kind) = map.next_key::<String>()? {
            match kind.as_str() {
                "set" | "map" => map.next_value_seed(Set(&mut *self.0))?,
                _ => {
                    let value = map.next_value::<Value>()?;
                    (self.0)(Item::Other(&kind, value));
                }
            }
        }
        Ok(())
    }
}

/// A set or map: its elements are given one by one as they are read, to
/// the set of the name read before them (nft prints the name first); any
/// read before a name are held until the set ends.
struct Set<'t>(Take<'t>);

impl<'de> Visitor<'de> for Set<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a set or map object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let (mut name, mut held) = (None, Vec::new());
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "name" => {
                    let value = map.next_value::<Value>()?;
                    name = Some(value.as_str().unwrap_or_default().to_owned());
                }
                "elem" => map.next_value_seed(Elems {
                    set: name.as_deref(),
                    held: &mut held,
                    take: &mut *self.0,
                })?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let name = name.unwrap_or_default();
        for elem in held {
            (self.0)(Item::Elem(&name, elem));
        }
        (self.0)(Item::Set(name));
        Ok(())
    }
}

/// A set's `elem` array.
struct Elems<'a, 't> {
    /// The set's name, when read already.
    set: Option<&'a str>,
    /// The elements read before the name.
    held: &'a mut Vec<Value>,
    take: Take<'t>,
}

impl<'de> Visitor<'de> for Elems<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array of elements")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(elem) = seq.next_element::<Value>()? {
            match self.set {
                Some(set) => (self.take)(Item::Elem(set, elem)),
                None => self.held.push(elem),
            }
        }
        Ok(())
    }
}

fn str_field(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// Takes the element `elem` of the set or map `set` into `obs`.
fn take_elem(set: &str, elem: &Value, obs: &mut Observed) {
    // A map element is `[key, value]`; an element with options is
    // wrapped in `{"elem": {"val": ...}}`.
    let (key, value) = match elem.as_array().map(Vec::as_slice) {
        Some([k, v]) => (k, Some(v)),
        _ => (elem, None),
    };
    let key = key.pointer("/elem/val").unwrap_or(key);
    if set.starts_with("cluster") {
        match parse_range(key) {
            Some(r) => {
                obs.cluster.insert(r);
            }
            None => tracing::warn!(set, elem = %elem, "unreadable element"),
        }
        return;
    }
    let Some(k) = parse_concat(key) else {
        tracing::warn!(set, elem = %elem, "unreadable element");
        return;
    };
    match (set, value) {
        ("classify4" | "classify6", Some(v)) => {
            let target = ["jump", "goto"]
                .iter()
                .find_map(|kind| v.pointer(&format!("/{kind}/target")))
                .and_then(Value::as_str)
                .unwrap_or_default();
            obs.classify.insert(k, Verdict::parse(target));
        }
        ("snat4" | "snat6", Some(v)) => {
            if let Some(to) = v.as_str().and_then(|s| s.parse().ok()) {
                obs.nat.insert(k, Nat::Snat(to));
            }
        }
        ("masq4" | "masq6", None) => {
            obs.nat.insert(k, Nat::Masquerade);
        }
        ("count4" | "count6", Some(v)) => {
            if let Some(counter) = v.as_str() {
                obs.count.insert(k, counter.to_owned());
            }
        }
        _ => {}
    }
}

/// `{"concat": [src, dst]}` with a single-address source.
fn parse_concat(key: &Value) -> Option<ElemKey> {
    match key.get("concat")?.as_array()?.as_slice() {
        [src, dst] => {
            let src = parse_range(src)?;
            (src.first() == src.last()).then_some(())?;
            Some(ElemKey {
                src: src.first(),
                dst: parse_range(dst)?,
            })
        }
        _ => None,
    }
}

/// `"10.0.0.1"`, `{"prefix": {"addr": .., "len": ..}}` or `{"range": [a, b]}`.
fn parse_range(v: &Value) -> Option<IpRange> {
    if let Some(s) = v.as_str() {
        return Some(IpRange::single(s.parse().ok()?));
    }
    if let Some(p) = v.get("prefix") {
        let addr: IpAddr = p.get("addr")?.as_str()?.parse().ok()?;
        let len = u8::try_from(p.get("len")?.as_u64()?).ok()?;
        return Some(IpRange::of_net(IpNet::new(addr, len).ok()?));
    }
    match v.get("range")?.as_array()?.as_slice() {
        [a, b] => IpRange::new(a.as_str()?.parse().ok()?, b.as_str()?.parse().ok()?),
        _ => None,
    }
}
