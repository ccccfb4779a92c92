//! Checks shared by the frame-decoder fuzz targets (included with `#[path]`;
//! not a target itself).

use stowage_wire::{decode_frame, encode, Envelope, Frame, Limits, Request, Response, PREFIX_LEN};

/// Decode `data` as a request frame and as a response frame under `limits`
/// and check every frame that parses.
pub fn check(data: &[u8], limits: &Limits) {
    if let Ok(Some((frame, used))) = decode_frame::<Request>(data, limits) {
        // Whatever validate says, it must not panic.
        let _ = frame.envelope.body.validate(limits);
        check_frame(data, frame, used, limits);
    }
    if let Ok(Some((frame, used))) = decode_frame::<Response>(data, limits) {
        check_frame(data, frame, used, limits);
    }
}

fn check_frame<T>(data: &[u8], frame: Frame<'_, T>, used: usize, limits: &Limits)
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    assert!(used <= data.len(), "used {used} > input {}", data.len());
    assert!(used >= PREFIX_LEN + frame.payload.len());
    // The payload is the tail of the consumed bytes.
    assert_eq!(frame.payload, &data[used - frame.payload.len()..used]);

    // Re-encode the envelope with the same id and payload length, append the
    // payload, and decode again. The bytes may differ from the input (postcard
    // accepts non-canonical varints, encode writes canonical ones), so compare
    // the decoded values. A canonical header is never longer than the one
    // that was accepted, so it also fits `limits`.
    let payload_len = frame.payload.len() as u64;
    let mut buf = Vec::new();
    encode(
        frame.envelope.id,
        &frame.envelope.body,
        payload_len,
        &mut buf,
    )
    .expect("re-encoding a decoded envelope failed");
    assert!(
        buf.len() <= used - frame.payload.len(),
        "canonical header longer than the accepted one"
    );
    buf.extend_from_slice(frame.payload);

    let (again, again_used) = match decode_frame::<T>(&buf, limits) {
        Ok(Some(x)) => x,
        other => panic!("re-encoded frame did not decode: {other:?}"),
    };
    assert_eq!(again_used, buf.len());
    let Envelope { id, body } = frame.envelope;
    assert_eq!(again.envelope.id, id);
    assert_eq!(again.envelope.body, body);
    assert_eq!(again.payload, frame.payload);
}
