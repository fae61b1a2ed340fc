//! GPT-2's byte ↔ printable-character table, used to turn byte-level BPE
//! token texts (`Ġhello`) back into raw bytes.

use std::sync::OnceLock;

/// Character that stands for each byte in byte-level BPE token texts.
fn byte_to_char_table() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = ['\0'; 256];
        // Printable Latin-1 bytes stand for themselves…
        let printable = |b: u32| {
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
        };
        // …every other byte is shifted to U+0100 and up, in byte order.
        let mut next_shifted = 0x100u32;
        for b in 0..256u32 {
            let c = if printable(b) {
                b
            } else {
                let c = next_shifted;
                next_shifted += 1;
                c
            };
            table[b as usize] = char::from_u32(c).unwrap_or('\u{fffd}');
        }
        table
    })
}

/// The character that stands for byte `b` in byte-level token texts.
pub(crate) fn byte_to_char(b: u8) -> char {
    byte_to_char_table()[b as usize]
}

/// Byte that each character below U+0144 stands for (`None` when it stands for none).
fn char_to_byte_table() -> &'static [Option<u8>; 0x144] {
    static TABLE: OnceLock<[Option<u8>; 0x144]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = [None; 0x144];
        for (b, &c) in byte_to_char_table().iter().enumerate() {
            table[c as usize] = Some(b as u8);
        }
        table
    })
}

/// Byte that a byte-level character stands for, if it is one.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    char_to_byte_table().get(c as usize).copied().flatten()
}

/// Raw bytes of a byte-level token text; characters outside the table are
/// kept as their UTF-8 encoding.
pub(crate) fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_characters() {
        assert_eq!(char_to_byte('Ġ'), Some(b' '));
        assert_eq!(char_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(char_to_byte('a'), Some(b'a'));
        assert_eq!(decode_byte_level("ĠhelloĊ"), b" hello\n");
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char_table()[b as usize]), Some(b));
        }
    }
}
