package dev.cbserve.client;

import cbserve.v1.Admin;
import cbserve.v1.Generation;
import cbserve.v1.Types;
import com.google.protobuf.Timestamp;
import io.grpc.Status;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.List;
import java.util.Optional;

/** Conversions from the cbserve.v1 messages to the SDK's values (no protobuf type leaks out). */
final class Convert {
  private Convert() {}

  static RequestStatus status(Types.RequestStatus status) {
    switch (status) {
      case REQUEST_STATUS_QUEUED:
        return RequestStatus.QUEUED;
      case REQUEST_STATUS_PREFILLING:
        return RequestStatus.PREFILLING;
      case REQUEST_STATUS_DECODING:
        return RequestStatus.DECODING;
      case REQUEST_STATUS_FINISHED:
        return RequestStatus.FINISHED;
      case REQUEST_STATUS_CANCELLED:
        return RequestStatus.CANCELLED;
      case REQUEST_STATUS_FAILED:
        return RequestStatus.FAILED;
      default:
        return RequestStatus.UNSPECIFIED;
    }
  }

  static FinishReason finishReason(Types.FinishReason reason) {
    switch (reason) {
      case FINISH_REASON_EOS:
        return FinishReason.EOS;
      case FINISH_REASON_LENGTH:
        return FinishReason.LENGTH;
      case FINISH_REASON_CANCELLED:
        return FinishReason.CANCELLED;
      case FINISH_REASON_ERROR:
        return FinishReason.ERROR;
      case FINISH_REASON_STOP:
        return FinishReason.STOP;
      default:
        return null;
    }
  }

  static Admin.PauseMode pauseMode(PauseMode mode) {
    switch (mode) {
      case WAIT:
        return Admin.PauseMode.PAUSE_MODE_WAIT;
      case ABORT:
        return Admin.PauseMode.PAUSE_MODE_ABORT;
      default:
        return Admin.PauseMode.PAUSE_MODE_KEEP;
    }
  }

  static Instant instant(Timestamp ts) {
    return Instant.ofEpochSecond(ts.getSeconds(), ts.getNanos());
  }

  static Duration seconds(double seconds) {
    return Duration.ofNanos(Math.round(seconds * 1e9));
  }

  static Usage usage(Types.Usage usage) {
    return new Usage(usage.getPromptTokens(), usage.getGeneratedTokens(), usage.getCachedTokens());
  }

  static Timings timings(Types.Timings t) {
    return new Timings(
        t.hasQueuedAt() ? instant(t.getQueuedAt()) : null,
        t.hasScheduledAt() ? instant(t.getScheduledAt()) : null,
        t.hasFirstTokenAt() ? instant(t.getFirstTokenAt()) : null,
        t.hasFinishedAt() ? instant(t.getFinishedAt()) : null,
        t.hasQueueTimeS() ? seconds(t.getQueueTimeS()) : null,
        t.hasTimeToFirstTokenS() ? seconds(t.getTimeToFirstTokenS()) : null);
  }

  /** A server timestamp in seconds since the epoch (double) as an instant (microsecond-exact). */
  static Instant epochSeconds(double seconds) {
    long micros = Math.round(seconds * 1e6);
    return Instant.ofEpochSecond(
        Math.floorDiv(micros, 1_000_000L), Math.floorMod(micros, 1_000_000L) * 1000L);
  }

  static Status.Code code(int number) {
    return Status.fromCodeValue(number).getCode(); // UNKNOWN for a number out of range
  }

  static Chunk chunk(Types.GenerationChunk c) {
    int[] tokenIds = new int[c.getTokenIdsCount()];
    for (int i = 0; i < tokenIds.length; i++) {
      tokenIds[i] = c.getTokenIds(i);
    }
    List<Instant> timestamps = new ArrayList<>(c.getTokenTimestampsCount());
    for (int i = 0; i < c.getTokenTimestampsCount(); i++) {
      timestamps.add(epochSeconds(c.getTokenTimestamps(i)));
    }
    List<TokenLogprob> logprobs = new ArrayList<>(c.getLogprobsCount());
    for (int i = 0; i < c.getLogprobsCount(); i++) {
      Types.TokenLogprob lp = c.getLogprobs(i);
      int tokenId = i < tokenIds.length ? tokenIds[i] : -1;
      Optional<Float> logKeptMass =
          lp.hasLogKeptMass() ? Optional.of(lp.getLogKeptMass()) : Optional.empty();
      logprobs.add(
          new TokenLogprob(tokenId, lp.getLogprob(), top(lp.getTopLogprobsList()), logKeptMass));
    }
    List<PromptLogprob> promptLogprobs = new ArrayList<>(c.getPromptLogprobsCount());
    for (Types.PromptLogprob lp : c.getPromptLogprobsList()) {
      promptLogprobs.add(
          new PromptLogprob(lp.getTokenId(), lp.getLogprob(), top(lp.getTopLogprobsList())));
    }
    return new Chunk(
        c.getRequestId(),
        c.getTokenIndex(),
        TokenIds.wrap(tokenIds),
        c.getText(),
        status(c.getStatus()),
        finishReason(c.getFinishReason()),
        c.getError().isEmpty() ? null : c.getError(),
        code(c.getErrorCode()),
        logprobs,
        c.hasUsage() ? usage(c.getUsage()) : null,
        c.hasTimings() ? timings(c.getTimings()) : null,
        c.getWeightVersion(),
        timestamps,
        c.getStopReasonCase() == Types.GenerationChunk.StopReasonCase.STOP_TOKEN_ID
            ? Optional.of(c.getStopTokenId())
            : Optional.empty(),
        c.getStopReasonCase() == Types.GenerationChunk.StopReasonCase.STOP_STRING
            ? Optional.of(c.getStopString())
            : Optional.empty(),
        promptLogprobs,
        c.getIndex());
  }

  private static List<TopLogprob> top(List<Types.TopLogprob> top) {
    List<TopLogprob> out = new ArrayList<>(top.size());
    for (Types.TopLogprob t : top) {
      out.add(new TopLogprob(t.getTokenId(), t.getLogprob()));
    }
    return out;
  }

  static ModelInfo modelInfo(Generation.GetModelInfoResponse r) {
    return new ModelInfo(
        r.getModelName(),
        r.getVocabSize(),
        r.getMaxContextLength(),
        r.getEosTokenIdsList(),
        r.getHasChatTemplate(),
        r.getHasTokenizer(),
        r.getWeightVersion());
  }

  static EngineStatus engineStatus(Admin.GetStatusResponse s) {
    return new EngineStatus(
        s.getRunning(),
        s.getPaused(),
        s.getPauseHolders(),
        s.getQueuedRequests(),
        s.getActiveRequests(),
        s.getKvBlocksUsed(),
        s.getKvBlocksTotal(),
        s.getPrefixCacheHitRate(),
        s.getWeightVersion(),
        s.getPreemptions(),
        s.getOffloads(),
        s.getRestores(),
        s.getRecomputedTokens(),
        s.getPrefixCacheQueries(),
        s.getPrefixCacheHits(),
        s.getFinishedRequests(),
        s.getPromptTokens(),
        s.getGeneratedTokens(),
        s.getCountersMap());
  }

  static StopResult stopResult(Admin.StopResponse r) {
    return new StopResult(r.getDrainedRequests(), r.getFailedRequests(), r.getAlreadyStopped());
  }
}
