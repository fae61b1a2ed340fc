//! Round trip: a GGUF written by the `gguf` Python package
//! (`scripts/gen_format_fixtures.py` → `fixtures/synthetic.gguf`) reads back
//! with every metadata type, the custom alignment, names, shapes and bytes.

mod common;

use common::fixture;
use flatrun_format::{DType, GgmlType, MetaValue, QuantDescriptor, StorageBackend};

fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn synthetic_gguf_metadata_round_trips() {
    let b = flatrun_format::open(&fixture("synthetic.gguf")).expect("open");
    let m = b.metadata();
    assert_eq!(m.get("t.u8"), Some(&MetaValue::U8(200)));
    assert_eq!(m.get("t.i8"), Some(&MetaValue::I8(-100)));
    assert_eq!(m.get("t.u16"), Some(&MetaValue::U16(60000)));
    assert_eq!(m.get("t.i16"), Some(&MetaValue::I16(-30000)));
    assert_eq!(m.get("t.u32"), Some(&MetaValue::U32(4_000_000_000)));
    assert_eq!(m.get("t.i32"), Some(&MetaValue::I32(-2_000_000_000)));
    assert_eq!(m.get("t.u64"), Some(&MetaValue::U64((1 << 40) + 7)));
    assert_eq!(m.get("t.i64"), Some(&MetaValue::I64(-(1 << 40))));
    assert_eq!(m.get("t.f32"), Some(&MetaValue::F32(1.5)));
    assert_eq!(m.get("t.f64"), Some(&MetaValue::F64(-2.25)));
    assert_eq!(m.get_bool("t.bool"), Some(true));
    assert_eq!(m.get_str("t.str"), Some("héllo"));
    assert_eq!(m.get_str_array("t.arr_str"), Some(vec!["a", "bc", ""]));
    assert_eq!(m.get_i32_array("t.arr_i32"), Some(vec![1, -2, 3]));
    assert_eq!(m.get_f32_array("t.arr_f32"), Some(vec![0.5, 1.5]));
    let nested = m
        .get("t.nested")
        .and_then(MetaValue::as_array)
        .expect("nested array");
    assert_eq!(nested.len(), 2);
    assert_eq!(nested[0].as_array().map(|a| a.len()), Some(2));
    assert_eq!(nested[1], MetaValue::Array(vec![MetaValue::I32(3)]));
    assert_eq!(m.get_u64("general.alignment"), Some(64));
}

#[test]
fn synthetic_gguf_tensors_round_trip() {
    let path = fixture("synthetic.gguf");
    let gguf = flatrun_format::GgufBackend::open(&path).expect("open");
    assert_eq!(gguf.header().alignment, 64);
    assert_eq!(gguf.header().data_offset % 64, 0);
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("synthetic.expected.json")).unwrap())
            .unwrap();
    let expected = expected["tensors"].as_array().unwrap();
    assert_eq!(gguf.tensors().len(), expected.len());
    for (t, want) in gguf.tensors().iter().zip(expected) {
        assert_eq!(t.name, want["name"].as_str().unwrap());
        assert_eq!(t.original_name, want["original"].as_str().unwrap());
        let shape: Vec<usize> = want["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(t.shape, shape, "{}", t.name);
        assert_eq!(t.dtype.to_string(), want["type"].as_str().unwrap());
        assert_eq!(t.offset % 64, 0, "{} aligned", t.name);
        let handle = gguf.tensor(&t.name).unwrap();
        assert_eq!(
            handle.bytes(),
            hex_decode(want["bytes"].as_str().unwrap()),
            "{}",
            t.name
        );
        assert_eq!(handle.to_vec(), handle.bytes());
        // Also reachable by the original name.
        assert_eq!(gguf.tensor(&t.original_name).unwrap().info(), t);
    }
    let q = gguf.tensor("layers.0.attn.q").unwrap();
    assert_eq!(q.dtype(), DType::Ggml(GgmlType::Q8_0));
    assert_eq!(q.quant(), QuantDescriptor::Ggml(GgmlType::Q8_0));
    assert_eq!(gguf.tensor("embed").unwrap().quant(), QuantDescriptor::None);
    assert!(matches!(
        gguf.tensor("nope"),
        Err(flatrun_format::FormatError::NoSuchTensor(_))
    ));
}
