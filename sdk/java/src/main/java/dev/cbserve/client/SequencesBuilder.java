package dev.cbserve.client;

import java.util.ArrayList;
import java.util.List;

/**
 * Assembles the chunks of a request's n sequences ({@link SamplingParams.Builder#n(int)}), which
 * come interleaved, into one {@link Completion} per sequence. The request is done once each of the
 * n sequences has sent its terminal chunk. Chunks of other requests, or of a sequence at or past n
 * (the caller asked for fewer), are ignored.
 */
final class SequencesBuilder {
  private final String requestId;
  private final CompletionBuilder[] sequences;
  private int ended;

  SequencesBuilder(String requestId, int n) {
    this.requestId = requestId;
    this.sequences = new CompletionBuilder[n];
    for (int i = 0; i < n; i++) {
      sequences[i] = new CompletionBuilder(requestId, i, 0);
    }
  }

  void add(Chunk chunk) {
    if (!chunk.requestId().equals(requestId)
        || chunk.index() < 0
        || chunk.index() >= sequences.length) {
      return;
    }
    CompletionBuilder sequence = sequences[chunk.index()];
    if (sequence.done()) {
      return; // nothing follows a sequence's terminal chunk
    }
    sequence.add(chunk);
    if (sequence.done()) {
      ended++;
    }
  }

  /** True once every sequence has ended. */
  boolean done() {
    return ended == sequences.length;
  }

  /**
   * The completions, ordered by index.
   *
   * @throws InternalException when a sequence has not ended (the stream ended before it did)
   */
  List<Completion> build() {
    List<Completion> completions = new ArrayList<>(sequences.length);
    for (CompletionBuilder sequence : sequences) {
      completions.add(sequence.build());
    }
    return List.copyOf(completions);
  }
}
