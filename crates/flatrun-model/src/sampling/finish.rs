/// Why a generation ended: reported by the runtime's `Generation` iterator
/// and by the server's scheduler; each HTTP API maps it to its own names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The requested number of tokens was generated.
    Length,
    /// The model emitted an end-of-generation token.
    Eos,
    /// The text reached a stop string (the one given; it is not part of the
    /// returned text).
    Stop(String),
    /// The sequence reached the end of its context.
    Context,
}
