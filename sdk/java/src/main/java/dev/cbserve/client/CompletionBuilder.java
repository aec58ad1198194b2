package dev.cbserve.client;

import io.grpc.Status;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Optional;

/**
 * Assembles a request's chunks (with n &gt; 1, one sequence's), in order, into a {@link Completion}.
 * Tokens are placed by their index: a chunk overlapping tokens already received only adds the new
 * ones; a gap is an error.
 */
final class CompletionBuilder {
  private final String requestId;
  private final int index;
  private final int start;
  private int[] tokenIds = new int[16];
  private int tokenCount;
  private final List<TokenLogprob> logprobs = new ArrayList<>();
  private final List<Instant> timestamps = new ArrayList<>();
  private final List<Long> weightVersions = new ArrayList<>();
  private final StringBuilder text = new StringBuilder();
  private Usage usage;
  private Timings timings;
  private FinishReason finishReason;
  private String error;
  private Optional<Integer> stopTokenId = Optional.empty();
  private Optional<String> stopString = Optional.empty();
  private List<PromptLogprob> promptLogprobs = List.of();

  CompletionBuilder(String requestId) {
    this(requestId, 0, 0);
  }

  /** The builder of sequence {@code index} of a request, from token {@code fromIndex} on. */
  CompletionBuilder(String requestId, int index, int fromIndex) {
    this.requestId = requestId;
    this.index = index;
    this.start = fromIndex;
  }

  void add(Chunk chunk) {
    int have = start + tokenCount;
    int count = chunk.tokenIds().size();
    if (chunk.tokenIndex() > have && count > 0) {
      throw new InternalException(
          Status.Code.DATA_LOSS,
          describe() + ": got tokens from index " + chunk.tokenIndex()
              + ", expected " + have,
          null);
    }
    int skip = Math.min(count, Math.max(0, have - chunk.tokenIndex()));
    if (tokenCount + count - skip > tokenIds.length) {
      tokenIds = Arrays.copyOf(tokenIds, Math.max(2 * tokenIds.length, tokenCount + count - skip));
    }
    for (int i = skip; i < count; i++) {
      tokenIds[tokenCount++] = chunk.tokenIds().getInt(i);
    }
    List<TokenLogprob> lps = chunk.logprobs();
    if (lps.size() > skip) {
      logprobs.addAll(lps.subList(skip, lps.size()));
    }
    List<Instant> ts = chunk.tokenTimestamps();
    if (ts.size() > skip) {
      timestamps.addAll(ts.subList(skip, ts.size()));
    }
    text.append(chunk.text());
    if (promptLogprobs.isEmpty()) {
      promptLogprobs = chunk.promptLogprobs();
    }
    if (chunk.usage() != null) {
      usage = chunk.usage();
    }
    if (chunk.timings() != null) {
      timings = chunk.timings();
    }
    long version = chunk.weightVersion();
    if (count > 0
        && version != 0
        && (weightVersions.isEmpty() || weightVersions.get(weightVersions.size() - 1) != version)) {
      weightVersions.add(version);
    }
    if (chunk.isFinished()) {
      FinishReason reason = chunk.finishReason();
      if (reason == null) {
        reason =
            chunk.status() == RequestStatus.CANCELLED ? FinishReason.CANCELLED : FinishReason.ERROR;
      }
      finishReason = reason;
      error = chunk.error();
      stopTokenId = chunk.stopTokenId();
      stopString = chunk.stopString();
    }
  }

  boolean done() {
    return finishReason != null;
  }

  Completion build() {
    if (finishReason == null) {
      throw new InternalException(
          Status.Code.UNKNOWN,
          "the stream of request " + requestId + " ended before "
              + (index == 0 ? "the request" : "its sequence " + index) + " finished",
          null);
    }
    return new Completion(
        requestId,
        TokenIds.wrap(Arrays.copyOf(tokenIds, tokenCount)),
        text.toString(),
        finishReason,
        usage,
        logprobs,
        weightVersions.isEmpty() ? 0 : weightVersions.get(weightVersions.size() - 1),
        weightVersions,
        error,
        timings,
        timestamps,
        stopTokenId,
        stopString,
        promptLogprobs,
        index);
  }

  /** "request ID", or "request ID (sequence I)" past the first sequence. */
  private String describe() {
    return "request " + requestId + (index == 0 ? "" : " (sequence " + index + ")");
  }
}
