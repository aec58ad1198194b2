package dev.cbserve.client;

import io.grpc.ManagedChannel;
import java.util.concurrent.TimeUnit;

/** Closes a channel: cancels its calls and waits a little for them to end. */
final class ChannelShutdown {
  private ChannelShutdown() {}

  static void shutdown(ManagedChannel channel) {
    channel.shutdownNow();
    try {
      channel.awaitTermination(5, TimeUnit.SECONDS);
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
    }
  }
}
